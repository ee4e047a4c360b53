"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 differ only in flags set by subclasses).

Checkpoint names are kept verbatim (`q_proj`, `gate_proj`, `input_layernorm`); q/k/v and
gate/up load into fused parameters through `packed_modules_mapping`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedlm.layers.activation import SiluAndMul, get_act_and_mul
from pagedlm.layers.attention import Attention
from pagedlm.layers.layernorm import RMSNorm
from pagedlm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlm.layers.rotary_embedding import get_rope
from pagedlm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.models.interfaces import ModelBase
from pagedlm.models.weight_utils import load_packed_weights
from pagedlm.platforms import current_platform


def rope_params(config: Any) -> tuple[float, dict | None]:
    scaling = getattr(config, "rope_scaling", None)
    theta = getattr(config, "rope_theta", None)
    if theta is None and isinstance(getattr(config, "rope_parameters", None), dict):
        theta = config.rope_parameters.get("rope_theta")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        scaling = {"original_max_position_embeddings": config.max_position_embeddings, **scaling}
    return float(theta or 10000.0), scaling


def run_decoder_layers(
    layers: nn.ModuleList,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    output_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, residual) after every layer; the last one gets `output_rows`."""
    residual = None
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        rows = output_rows if i == last else None
        hidden_states, residual = layer(positions, hidden_states, residual, rows)
    assert residual is not None, "a model has at least one layer"
    return hidden_states, residual


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, activation_block=256
        )
        self.act_fn = get_act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunk = current_platform.dense_chunk_rows
        if chunk is None or x.shape[0] <= chunk:
            return self.down_proj(self._gate_up_act(x))
        return torch.cat([self.forward(rows) for rows in x.split(chunk)])

    def _gate_up_act(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, in one pass where gate_up's method has one for SiLU."""
        if isinstance(self.act_fn, SiluAndMul):
            y = self.gate_up_proj.silu_and_mul(x)
            if y is not None:
                return y
        return self.act_fn(self.gate_up_proj(x))


class LlamaAttention(nn.Module):
    qkv_bias_default = False  # Qwen2 always has q/k/v bias
    use_qk_norm = False  # Qwen3 normalises q and k per head

    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        attention_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            hidden,
            self.head_dim,
            total_heads,
            total_kv_heads,
            bias=attention_bias or self.qkv_bias_default,
        )
        # this tensor-parallel rank's heads
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=attention_bias)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        theta, scaling = rope_params(config)
        rotary_dim = int(self.head_dim * getattr(config, "partial_rotary_factor", 1.0))
        self.rotary_emb = get_rope(self.head_dim, rotary_dim, max_position, theta, scaling)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=self.layer_sliding_window(config, layer_idx),
        )

    @staticmethod
    def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
        window = getattr(config, "sliding_window", None)
        if not window or not getattr(config, "use_sliding_window", True):
            return None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer_idx] == "sliding_attention" else None
        max_window_layers = getattr(config, "max_window_layers", None)
        if max_window_layers is not None and layer_idx >= max_window_layers:
            return None
        return window

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's key/value goes to the cache; `output_rows`: only these rows attend and
        are returned (the last layer, attention/backend.py)."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_qk_norm:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        if output_rows is not None:
            q = q[output_rows]
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, max_position)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`output_rows`: only these rows' queries attend, and only they are computed on and
        returned (every row's key and value still reach the cache)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, max_position) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[num_tokens, hidden], or [len(output_rows), hidden]: the last layer computes only
        the rows the step uses (worker/step_inputs.py) from its attention's queries on.
        `inputs_embeds` (images scattered into the token embeddings) replaces the lookup."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden_states, residual = run_decoder_layers(
            self.layers, positions, hidden_states, output_rows
        )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(ModelBase):
    model_cls: type[LlamaModel] = LlamaModel
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    supports_output_rows = True  # forward(..., output_rows) computes only those rows' outputs

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, max_position)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, output_rows)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("rotary_emb.inv_freq",)
        if getattr(self.config, "tie_word_embeddings", False):
            skip += ("lm_head.weight",)
        return load_packed_weights(self, weights, self.stacked_params_mapping, skip)
