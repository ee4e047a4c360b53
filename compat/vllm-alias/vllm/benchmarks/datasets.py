"""vllm.benchmarks.datasets (imported by vLLM's spec_decode example): not provided."""

from vllm._unsupported import unsupported_function

_WHY = "vLLM's benchmark datasets are not part of pagedlm; use its benchmarks/ scripts."
add_dataset_parser = unsupported_function("vllm.benchmarks.datasets.add_dataset_parser", _WHY)
get_samples = unsupported_function("vllm.benchmarks.datasets.get_samples", _WHY)
