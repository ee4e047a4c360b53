"""vllm.logprobs -> pagedlm.logprobs."""

from pagedlm.logprobs import (  # noqa: F401
    FlatLogprobs,
    Logprob,
    PromptLogprobs,
    SampleLogprobs,
)
