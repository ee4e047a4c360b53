"""vllm.v1.attention: see vllm.attention."""
