"""vllm.transformers_utils."""
