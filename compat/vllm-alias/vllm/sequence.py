"""vllm.sequence (older vLLM kept Logprob here) -> pagedlm.logprobs."""

from pagedlm.logprobs import Logprob  # noqa: F401
