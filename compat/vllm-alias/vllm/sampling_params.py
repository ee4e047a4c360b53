"""vllm.sampling_params -> pagedlm.sampling_params."""

from pagedlm.sampling_params import (  # noqa: F401
    BeamSearchParams,
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)

StructuredOuputsParams = StructuredOutputsParams  # the misspelling one vLLM release exported
