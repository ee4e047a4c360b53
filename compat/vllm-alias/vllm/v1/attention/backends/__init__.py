"""vllm.v1.attention.backends: see vllm.attention."""
