"""vllm.worker -> pagedlm.worker."""
