"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


class ModelRegistry:
    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(_MODELS)

    @staticmethod
    def resolve_model_cls(architecture: str) -> type[nn.Module]:
        if architecture not in _MODELS:
            raise ValueError(
                f"Model architecture {architecture!r} is not supported. Supported architectures: "
                f"{', '.join(ModelRegistry.get_supported_archs())}."
            )
        module, cls = _MODELS[architecture]
        return getattr(importlib.import_module(f"pagedlm.models.{module}"), cls)

    @staticmethod
    def register_model(architecture: str, module: str, cls: str) -> None:
        _MODELS[architecture] = (module, cls)
