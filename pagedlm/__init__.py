"""pagedlm: offline batch LLM inference that speaks the vLLM offline API."""

from pagedlm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from pagedlm.engine.async_llm import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.entrypoints.llm import LLM
from pagedlm.inputs import PromptType, TextPrompt, TokensPrompt
from pagedlm.models.registry import ModelRegistry
from pagedlm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import SamplingParams

__version__ = "0.1.0"
__version_tuple__ = (0, 1, 0)

__all__ = [
    "LLM",
    "ModelRegistry",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "SamplingParams",
    "PoolingParams",
    "RequestOutput",
    "CompletionOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "LLMEngine",
    "EngineArgs",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "__version__",
    "__version_tuple__",
]
