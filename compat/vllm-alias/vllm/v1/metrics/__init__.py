"""vllm.v1.metrics."""
