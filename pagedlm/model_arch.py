"""vLLM's ModelConfig queries over the Hugging Face config (scripts and tools read them).

Mixed into `pagedlm.config.ModelConfig`; everything derives from `hf_config`, nothing is stored.
pagedlm serves dense decoder and encoder models, and vision-language decoders (images), so the
MoE / encoder-decoder predicates answer False.
"""

from __future__ import annotations

from typing import Any, Protocol


class _Parallel(Protocol):
    tensor_parallel_size: int


class ModelArchQueries:
    hf_config: Any
    quantization: str | None

    @property
    def hf_text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    def get_vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    def get_hidden_size(self) -> int:
        return int(self.hf_text_config.hidden_size)

    def get_inputs_embeds_size(self) -> int:
        return self.get_hidden_size()

    @property
    def embedding_size(self) -> int:
        """The size of a pooled embedding: the config's `embedding_size` if set, else hidden."""
        override = getattr(self.hf_config, "embedding_size", None)
        return int(override) if override is not None else self.get_hidden_size()

    def get_head_size(self) -> int:
        text = self.hf_text_config
        head_dim = getattr(text, "head_dim", None)
        return int(head_dim) if head_dim else self.get_hidden_size() // text.num_attention_heads

    def get_total_num_kv_heads(self) -> int:
        text = self.hf_text_config
        return int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)

    def get_num_kv_heads(self, parallel_config: _Parallel) -> int:
        """KV heads per rank (replicated when fewer than ranks)."""
        return max(1, self.get_total_num_kv_heads() // parallel_config.tensor_parallel_size)

    def get_num_attention_heads(self, parallel_config: _Parallel) -> int:
        return int(self.hf_text_config.num_attention_heads) // parallel_config.tensor_parallel_size

    def get_total_num_hidden_layers(self) -> int:
        return int(self.hf_text_config.num_hidden_layers)

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self.get_total_num_hidden_layers()  # no pipeline parallelism: every layer

    def get_sliding_window(self) -> int | None:
        return getattr(self.hf_text_config, "sliding_window", None)

    def get_num_experts(self) -> int:
        return 0

    @property
    def is_matryoshka(self) -> bool:
        config = self.hf_config
        return bool(getattr(config, "is_matryoshka", False) or self.matryoshka_dimensions)

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        return getattr(self.hf_config, "matryoshka_dimensions", None)

    @property
    def is_quantized(self) -> bool:
        return self.quantization is not None

    @property
    def is_multimodal_model(self) -> bool:
        return getattr(self.hf_config, "vision_config", None) is not None

    @property
    def uses_mrope(self) -> bool:
        """Multimodal rotary positions (Qwen2-VL family): three position ids per token."""
        text = self.hf_text_config
        for rope in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
            if isinstance(rope, dict) and "mrope_section" in rope:
                return True
        return False

    # pagedlm has none of these model kinds
    is_encoder_decoder = False
    is_moe = False
    is_hybrid = False
    is_attention_free = False
    use_mla = False
