"""vllm.config.model: ModelConfig and the runner / convert option types."""

from typing import Any, Literal

from pagedlm.config import ModelConfig as _ModelConfig
from pagedlm.engine.arg_utils import EngineArgs

RunnerOption = Literal["auto", "generate", "pooling", "draft"]
ConvertOption = Literal["auto", "none", "embed", "classify"]


class _BuiltFromOptions(type):
    """vLLM builds `ModelConfig(model=..., dtype=...)` and lets it resolve the rest (Ray Data
    LLM's multimodal stage does); here EngineArgs resolves it, so the result is the same
    pagedlm ModelConfig an engine holds, and every pagedlm ModelConfig is an instance."""

    def __call__(cls, model: str, **options: Any) -> _ModelConfig:
        try:
            args = EngineArgs(model=model, **options)
        except TypeError as e:
            raise TypeError(
                f"vllm.config.ModelConfig(...) takes pagedlm's EngineArgs options: {e}"
            ) from e
        return args.create_engine_config().model_config

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _ModelConfig)


class ModelConfig(_ModelConfig, metaclass=_BuiltFromOptions):
    """pagedlm's ModelConfig, built from vLLM-style options."""
