"""vllm.renderers."""
