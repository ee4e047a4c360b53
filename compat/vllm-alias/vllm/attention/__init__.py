"""vllm.attention: pagedlm chooses its own attention backend (C kernels on CPU); vLLM's
backend classes are not provided. Importing works; using a name raises."""

from vllm._unsupported import missing_attribute


def __getattr__(name: str):
    raise missing_attribute("vllm.attention", name)
