"""Rotary position embedding (NeoX / Hugging Face `rotate_half` layout) with rope scaling.

cos/sin are cached in fp32 for every position and cast to the activation dtype when applied,
as Hugging Face does. Supported `rope_scaling` types: default, linear, llama3, yarn.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from pagedlm.kernels import cpu as cpu_kernels


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or max_position
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    base: float, rotary_dim: int, rope_scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling applied to cos/sin."""
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", "mrope"):  # M-RoPE: default frequencies, split in sections
        return _default_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, rotary_dim) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(base, rotary_dim), scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, scaling, max_position)
    raise NotImplementedError(
        f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3, "
        "yarn)."
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k laid out [num_tokens, num_heads * head_size]."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        inv_freq, scaling = compute_inv_freq(base, rotary_dim, rope_scaling, max_position)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        if passthrough.shape[-1]:
            out = torch.cat((out, passthrough), dim=-1)
        return out.reshape(num_tokens, -1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (query, key); the CPU kernel rotates them in place."""
        lib = cpu_kernels.kernels_for(query, key)
        if lib is not None and query.stride(-1) == 1 and key.stride(-1) == 1:
            cpu_kernels.rotary_embedding(
                lib, positions, query, key, self.cos_cache, self.sin_cache, self.head_size
            )
            return query, key
        cos = self.cos_cache[positions].unsqueeze(1).to(query.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


# live rotary embeddings by their arguments: every layer of a model shares one (its tables
# are read-only), as vLLM's get_rope does; held weakly, so they go with their models
_ROPES: weakref.WeakValueDictionary[tuple, RotaryEmbedding] = weakref.WeakValueDictionary()


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    """The rotary embedding `rope_scaling` asks for, M-RoPE where it has an `mrope_section`;
    one module per set of arguments and default device (24 layers held 24 copies of the
    cos/sin tables, 24 MB at 2048 positions)."""
    key = (
        head_size,
        rotary_dim,
        max_position,
        base,
        repr(sorted((rope_scaling or {}).items())),
        str(torch.get_default_device()),
    )
    rope = _ROPES.get(key)
    if rope is None:
        if rope_scaling and "mrope_section" in rope_scaling:
            section = list(rope_scaling["mrope_section"])
            rope = MRotaryEmbedding(head_size, rotary_dim, max_position, base, section)
        else:
            rope = RotaryEmbedding(head_size, rotary_dim, max_position, base, rope_scaling)
        _ROPES[key] = rope
    return rope


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL family): positions [3, num_tokens] of (time, height, width);
    rotary frequency j takes its position from section s of `mrope_section` that holds j (the
    same sections over both halves of the NeoX layout). Positions [num_tokens] (text, where the
    three are equal) are plain RoPE."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        mrope_section: list[int],
    ) -> None:
        super().__init__(head_size, rotary_dim, max_position, base)
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(
                f"mrope_section {mrope_section} must add up to half the rotary dim "
                f"({rotary_dim // 2})."
            )
        section_of = torch.repeat_interleave(
            torch.arange(len(mrope_section)), torch.tensor(mrope_section)
        )
        self.register_buffer("section_of", torch.cat((section_of, section_of)), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        index = self.section_of.unsqueeze(0).unsqueeze(0).expand(1, positions.shape[1], -1)
        cos = self.cos_cache[positions].gather(0, index)[0].unsqueeze(1).to(query.dtype)
        sin = self.sin_cache[positions].gather(0, index)[0].unsqueeze(1).to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
