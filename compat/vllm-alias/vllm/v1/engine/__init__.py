"""vllm.v1.engine."""
