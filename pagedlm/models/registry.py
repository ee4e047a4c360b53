"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily.

`resolve_model_cls(arch, runner, convert)` also decides the runner: generative architectures
run as generators unless `runner="pooling"` / `convert=...` turns them into pooling models;
encoder and *ForSequenceClassification architectures are pooling models.
"""

from __future__ import annotations

import importlib

from pagedlm.models.interfaces import ModelBase

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
}
# architecture -> (module, class, pooling task)
_POOLING_MODELS: dict[str, tuple[str, str, str]] = {
    "BertModel": ("bert", "BertModel", "embed"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification", "classify"),
}
# *ForSequenceClassification / bare decoders built from a generative class by an adapter
_ADAPTED: dict[str, tuple[str, str]] = {
    "Qwen2ForSequenceClassification": ("Qwen2ForCausalLM", "classify"),
    "Qwen3ForSequenceClassification": ("Qwen3ForCausalLM", "classify"),
    "LlamaForSequenceClassification": ("LlamaForCausalLM", "classify"),
    "Qwen2Model": ("Qwen2ForCausalLM", "embed"),
    "Qwen3Model": ("Qwen3ForCausalLM", "embed"),
    "LlamaModel": ("LlamaForCausalLM", "embed"),
}


def _load(module: str, cls: str) -> type[ModelBase]:
    model_cls = getattr(importlib.import_module(f"pagedlm.models.{module}"), cls)
    if not (isinstance(model_cls, type) and issubclass(model_cls, ModelBase)):
        raise TypeError(
            f"pagedlm.models.{module}.{cls} must derive from pagedlm.models.interfaces.ModelBase "
            "(it declares what the engine asks of a model)."
        )
    return model_cls


class ModelRegistry:
    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted({*_MODELS, *_POOLING_MODELS, *_ADAPTED})

    @staticmethod
    def register_model(architecture: str, module: str, cls: str) -> None:
        _MODELS[architecture] = (module, cls)

    @staticmethod
    def resolve_model_cls(
        architecture: str, runner: str = "auto", convert: str = "auto"
    ) -> tuple[type[ModelBase], str, str | None]:
        """(model class, runner type "generate"|"pooling", pooling task or None)."""
        from pagedlm.models.adapters import as_embedding_model, as_seq_cls_model

        if architecture in _POOLING_MODELS:
            if runner == "generate":
                raise ValueError("This model does not support generation")
            module, cls, task = _POOLING_MODELS[architecture]
            return _load(module, cls), "pooling", task
        if architecture in _ADAPTED:
            if runner == "generate":
                raise ValueError("This model does not support generation")
            base, task = _ADAPTED[architecture]
            causal = _load(*_MODELS[base])
            adapt = as_seq_cls_model if task == "classify" else as_embedding_model
            return adapt(causal), "pooling", task
        if architecture not in _MODELS:
            raise ValueError(
                f"Model architecture {architecture!r} is not supported. Supported architectures: "
                f"{', '.join(ModelRegistry.get_supported_archs())}."
            )
        causal = _load(*_MODELS[architecture])
        if (runner == "pooling" or convert in ("embed", "classify")) and causal.mm_processor_cls:
            raise NotImplementedError(
                f"{architecture} as a pooling model (runner='pooling', convert=...) is not "
                "supported by pagedlm; vision-language models generate."
            )
        if runner == "pooling" or convert in ("embed", "classify"):
            if convert == "classify":
                return as_seq_cls_model(causal), "pooling", "classify"
            return as_embedding_model(causal), "pooling", "embed"
        return causal, "generate", None

    @staticmethod
    def image_placeholder(architecture: str) -> str | None:
        """The text a string chat template gets per image (None: the model takes no images)."""
        processor = ModelRegistry.resolve_model_cls(architecture)[0].mm_processor_cls
        return processor.placeholder_str if processor is not None else None
