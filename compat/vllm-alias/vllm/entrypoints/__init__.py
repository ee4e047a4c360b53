"""vllm.entrypoints."""
