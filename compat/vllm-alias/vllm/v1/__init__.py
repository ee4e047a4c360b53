"""vllm.v1."""
