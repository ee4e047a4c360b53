"""The Attention layer models call: it owns nothing but its KV cache view and its options."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.backend import AttentionBackend
from pagedlm.attention.kv_cache_dtype import calculate_kv_scales, is_fp8
from pagedlm.forward_context import get_attn_metadata


class Attention(nn.Module):
    """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D].

    Decoder layers write k/v to the paged cache, then attend causally; encoder-only layers
    attend bidirectionally within each request and keep no cache. A decoder layer may pass the
    queries of the step's output rows only (q [R, H*D], R < T; attention/backend.py): -> [R, H*D].
    """

    backend: AttentionBackend | None = None  # set by the model runner for all layers

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        attn_type: str = "decoder",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.attn_type = attn_type  # "decoder" (causal, paged KV) or "encoder_only"
        self.kv_cache: torch.Tensor = torch.empty(0)
        # per-tensor scales of an fp8 KV cache (vLLM's k_scale / v_scale), 1.0 unless calibrated
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.calculate_kv_scales = False  # set from the cache config with the KV cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: every token's rows, or (the last layer) the output rows'; k, v: every token's."""
        num_rows = q.shape[0]
        backend = Attention.backend
        assert backend is not None, "the model runner sets Attention.backend"
        if self.attn_type == "encoder_only":
            out = backend.forward_encoder(
                q.view(num_rows, self.num_heads, self.head_size),
                k.view(num_rows, self.num_kv_heads, self.head_size),
                v.view(num_rows, self.num_kv_heads, self.head_size),
                get_attn_metadata(),
                self.scale,
            )
            return out.reshape(num_rows, self.num_heads * self.head_size)
        if self.calculate_kv_scales and is_fp8(self.kv_cache.dtype):
            self.k_scale, self.v_scale = calculate_kv_scales(k, v)
            self.calculate_kv_scales = False
        out = backend.forward(
            q.view(num_rows, self.num_heads, self.head_size),
            k.view(k.shape[0], self.num_kv_heads, self.head_size),
            v.view(v.shape[0], self.num_kv_heads, self.head_size),
            self.kv_cache,
            get_attn_metadata(),
            self.scale,
            self.sliding_window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return out.view(num_rows, self.num_heads * self.head_size)


def paged_attention_layers(model: nn.Module) -> list[Attention]:
    """The layers of `model` that keep a paged KV cache (decoder attention), in order."""
    return [m for m in model.modules() if isinstance(m, Attention) and m.attn_type == "decoder"]


def kv_cache_bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over `layers` (K and V of every layer's KV heads)."""
    return sum(
        2 * block_size * layer.num_kv_heads * layer.head_size * dtype.itemsize for layer in layers
    )


def allocate_kv_caches(
    layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, kv_heads, head_size] tensor per layer, set as the
    layer's `kv_cache`. Zeroed (not empty) because padded attention reads unwritten slots
    under a mask, and 0 * NaN would poison the output; pages are mapped lazily, as blocks
    are first used."""
    from pagedlm.platforms import current_platform

    caches = []
    for layer in layers:
        shape = (2, num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        layer.kv_cache = current_platform.zeros_lazy(shape, dtype, parts=2)  # K, V
        caches.append(layer.kv_cache)
    return caches
