"""vllm.config.model: ModelConfig and the runner / convert option types."""

from typing import Literal

from pagedlm.config import ModelConfig  # noqa: F401

RunnerOption = Literal["auto", "generate", "pooling", "draft"]
ConvertOption = Literal["auto", "none", "embed", "classify"]
