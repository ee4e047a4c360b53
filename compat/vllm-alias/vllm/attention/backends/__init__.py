"""vllm.attention.backends: see vllm.attention."""
