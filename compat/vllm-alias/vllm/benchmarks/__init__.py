"""vllm.benchmarks: pagedlm's benchmarks live in its repository's benchmarks/ folder."""
