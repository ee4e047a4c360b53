"""The Attention layer models call: it owns nothing but its KV cache view and its options."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.backend import AttentionBackend
from pagedlm.forward_context import get_attn_metadata


class Attention(nn.Module):
    """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]; writes k/v to the paged cache first."""

    backend: AttentionBackend | None = None  # set by the model runner for all layers

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        assert Attention.backend is not None, "the model runner sets Attention.backend"
        out = Attention.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            self.kv_cache,
            get_attn_metadata(),
            self.scale,
            self.sliding_window,
        )
        return out.view(num_tokens, self.num_heads * self.head_size)
