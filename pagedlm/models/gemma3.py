"""Gemma 3 (text): Gemma3ForCausalLM, built from the shared layers.

Differences from the Llama decoder, all as in transformers' `modeling_gemma3.py`:
- embeddings are multiplied by sqrt(hidden_size), the factor cast to the activation dtype first;
- every RMSNorm scales by (1 + weight) in fp32 (`RMSNorm(offset=1.0)`), including the per-head
  q_norm / k_norm applied before RoPE;
- four norms per layer: the attention and MLP outputs are normed (post_attention_layernorm,
  post_feedforward_layernorm) before they are added to the residual stream;
- gated MLP with gelu (tanh approximation); attention scale `query_pre_attn_scalar ** -0.5`;
- sliding-window and global layers (`layer_types`, or `sliding_window_pattern` in older
  configs); sliding layers use RoPE base `rope_local_base_freq` without scaling, global layers
  `rope_theta` with `rope_scaling` (transformers >= 5 keeps both in `rope_parameters` per layer
  type);
- optional final logit softcapping; tied embeddings by default.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedlm.layers.attention import Attention
from pagedlm.layers.layernorm import RMSNorm
from pagedlm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedlm.layers.rotary_embedding import get_rope
from pagedlm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.models.interfaces import ModelBase
from pagedlm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, run_decoder_layers
from pagedlm.models.weight_utils import load_packed_weights

_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def layer_type(config: Any, layer_idx: int) -> str:
    """'sliding_attention' or 'full_attention' for layer `layer_idx`."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_idx]
    pattern = (
        getattr(config, "sliding_window_pattern", None)
        or getattr(config, "_sliding_window_pattern", None)
        or 6
    )
    return "sliding_attention" if (layer_idx + 1) % pattern else "full_attention"


def gemma3_rope_params(config: Any, kind: str) -> tuple[float, dict | None]:
    """(base, rope_scaling) for layers of `kind` ('sliding_attention' or 'full_attention')."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(kind), dict):  # transformers >= 5
        scaling = dict(params[kind])
        theta = scaling.pop("rope_theta", None)
    elif kind == "sliding_attention":
        theta, scaling = getattr(config, "rope_local_base_freq", None), None
    else:
        theta = getattr(config, "rope_theta", None)
        scaling = getattr(config, "rope_scaling", None)
        if theta is None and isinstance(params, dict):
            theta = params.get("rope_theta")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        scaling = {"original_max_position_embeddings": config.max_position_embeddings, **scaling}
    return float(theta or _DEFAULT_THETA[kind]), scaling or None


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("Gemma 3 with attn_logit_softcapping is not supported.")
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma 3 with bidirectional attention is not supported.")
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias)
        # this tensor-parallel rank's heads
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, offset=1.0)
        kind = layer_type(config, layer_idx)
        self.is_sliding = kind == "sliding_attention"
        theta, scaling = gemma3_rope_params(config, kind)
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, max_position, theta, scaling)
        window = getattr(config, "sliding_window", None)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            config.query_pre_attn_scalar**-0.5,
            self.num_kv_heads,
            sliding_window=window if self.is_sliding and window else None,
        )

    # LlamaAttention's forward reads these attributes: q/k norms per head, output rows
    use_qk_norm = True
    forward = LlamaAttention.forward


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, max_position)
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.mlp = LlamaMLP(hidden, config.intermediate_size, act, bias=False)
        self.input_layernorm = RMSNorm(hidden, eps=eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps=eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps=eps, offset=1.0)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before it); the next norm adds them.
        `output_rows`: as LlamaDecoderLayer.forward, only these rows attend and go on."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # fp32 here, cast to the activation dtype in forward (HF rounds sqrt(3072) to 55.5 in bf16)
        self.register_buffer(
            "normalizer", torch.tensor(config.hidden_size**0.5, dtype=torch.float32), False
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, max_position) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds`: already scaled embeddings (images scattered in) replace the lookup."""
        if inputs_embeds is None:
            hidden_states = self.embed_tokens(input_ids)
            hidden_states = hidden_states * self.normalizer.to(hidden_states.dtype)
        else:
            hidden_states = inputs_embeds
        hidden_states, residual = run_decoder_layers(
            self.layers, positions, hidden_states, output_rows
        )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma3ForCausalLM(ModelBase):
    model_cls = Gemma3Model  # as LlamaForCausalLM.model_cls: the pooling adapters build it
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    supports_output_rows = LlamaForCausalLM.supports_output_rows
    forward = LlamaForCausalLM.forward  # self.model(input_ids, positions, output_rows)

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, max_position)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tied = getattr(config, "tie_word_embeddings", True)
        if self.tied:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden_states)
        if logits is not None and self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tied:
            skip += ("lm_head.weight",)
        return load_packed_weights(self, weights, self.stacked_params_mapping, skip)
