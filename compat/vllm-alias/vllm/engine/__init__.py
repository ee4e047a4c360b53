"""vllm.engine."""
