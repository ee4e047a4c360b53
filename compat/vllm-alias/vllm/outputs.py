"""vllm.outputs -> pagedlm.outputs."""

from pagedlm.outputs import (  # noqa: F401
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    RequestStateStats,
    ScoringOutput,
    ScoringRequestOutput,
)
