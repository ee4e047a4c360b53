"""Qwen2.5-VL vision encoder: patch embedding, windowed ViT blocks, 2x2 patch merger.

Input rows are the image processor's patches, flattened as (channel, time, row, col) and
ordered per image block-major: frame, merged row, merged column, then the `merge x merge`
patches of that merged cell row-major. The encoder regroups the merged cells into attention
windows (`window_size` pixels square), runs the blocks (window attention, except full
attention per frame in `fullatt_block_indexes`), merges each cell's patches into one output
row and restores the processor's order. Attention never spans two images (or frames).
Parameter names are Hugging Face's with the `model.visual.` / `visual.` prefix removed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
}


class _RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast back to the input dtype before the weight multiplies."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class _PatchEmbed(nn.Module):
    """HF's Conv3d with kernel == stride, as one matmul over each flattened patch.

    `proj.weight` is kept 2-D `[hidden, in_channels*temporal*patch*patch]`; the checkpoint's 5-D
    conv weight is reshaped into it on load (same (channel, time, row, col) flattening).
    """

    def __init__(self, in_dim: int, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class _MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}")
        self.gate_proj = nn.Linear(dim, inner)
        self.up_proj = nn.Linear(dim, inner)
        self.down_proj = nn.Linear(inner, dim)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _segment_groups(seqlens: list[int], device: torch.device) -> list[torch.Tensor]:
    """Row indices of contiguous segments, grouped by length: each entry is `[n_segments, L]`."""
    starts: dict[int, list[int]] = {}
    offset = 0
    for length in seqlens:
        if length:
            starts.setdefault(length, []).append(offset)
        offset += length
    return [
        torch.tensor(s, device=device)[:, None] + torch.arange(length, device=device)
        for length, s in starts.items()
    ]


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        """`cos`/`sin` are fp32 `[N, head_dim]`; rows attend only within their segment."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos[:, None], sin[:, None]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        for idx in groups:  # [segments, L]: one batched SDPA per distinct segment length
            qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))
            out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class _Block(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(cfg.hidden_size)
        self.norm2 = _RMSNorm(cfg.hidden_size)
        self.attn = _Attention(cfg.hidden_size, cfg.num_heads)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """RMS norm per patch, then an MLP over each merged cell's `merge**2` concatenated patches."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.cell_dim = dim * merge**2
        self.ln_q = _RMSNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.cell_dim, self.cell_dim), nn.GELU(), nn.Linear(self.cell_dim, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.cell_dim))


class Qwen2_5_VisionTransformer(nn.Module):
    """Pixel patches `[P, C*T*p*p]` -> merged embeddings `[P / merge**2, out_hidden_size]`."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        self.hidden_size = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_heads)
        self.patch_size = int(cfg.patch_size)
        self.merge = int(cfg.spatial_merge_size)
        self.window_size = int(cfg.window_size)
        self.fullatt_block_indexes = {int(i) for i in cfg.fullatt_block_indexes}
        in_dim = int(cfg.in_channels) * int(cfg.temporal_patch_size) * self.patch_size**2
        self.patch_embed = _PatchEmbed(in_dim, self.hidden_size)
        self.blocks = nn.ModuleList([_Block(cfg) for _ in range(int(cfg.depth))])
        self.merger = _PatchMerger(int(cfg.out_hidden_size), self.hidden_size, self.merge)
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))

    def _layout(
        self, grid_thw: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """Window order of the merged cells, (h, w) of every patch (processor order), and the
        window / per-frame segment lengths in patches (window order; frames stay contiguous)."""
        unit = self.merge**2
        side = self.window_size // self.merge // self.patch_size  # window side in merged cells
        order, positions, windows, frames = [], [], [], []
        base = 0
        for t, h, w in grid_thw.tolist():
            lh, lw = h // self.merge, w // self.merge
            nwh, nww = -(-lh // side), -(-lw // side)
            tt, rr, cc = torch.meshgrid(
                torch.arange(t), torch.arange(lh), torch.arange(lw), indexing="ij"
            )
            win = (tt * nwh + rr // side) * nww + cc // side
            key = win * side * side + (rr % side) * side + cc % side
            order.append(torch.argsort(key.flatten()) + base)
            windows += [n * unit for n in torch.bincount(win.flatten()).tolist() if n]
            frames += [h * w] * t
            base += t * lh * lw
            m = torch.arange(self.merge)
            ir, ic = torch.meshgrid(m, m, indexing="ij")
            hh = rr[0, :, :, None, None] * self.merge + ir  # [lh, lw, m, m], block-major
            ww = cc[0, :, :, None, None] * self.merge + ic
            positions.append(torch.stack([hh.flatten(), ww.flatten()], -1).repeat(t, 1))
        window_index = torch.cat(order).to(device)
        return window_index, torch.cat(positions).to(device), windows, frames

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Images in `grid_thw` order; image i gives its `t*h*w / merge**2` rows in the
        processor's merged-cell order (what `<|image_pad|>` tokens take)."""
        device = pixel_values.device
        unit = self.merge**2
        window_index, pos, windows, frames = self._layout(grid_thw, device)
        if pos.shape[0] != pixel_values.shape[0]:
            raise ValueError(
                f"grid_thw gives {pos.shape[0]} patches, pixel_values has {pixel_values.shape[0]}"
            )
        x = self.patch_embed(pixel_values)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[window_index].reshape(n, -1)
        # fp32 whatever the weights' dtype (so not a buffer, which .to(dtype) would cast)
        half = self.hidden_size // self.num_heads // 2  # h and w each rotate half a head
        exponent = torch.arange(0, half, 2, dtype=torch.float32, device=device) / half
        freqs = pos[..., None].float() * (1.0 / self.rope_theta**exponent)  # [N, 2, head_dim/4]
        emb = freqs.flatten(1)  # h freqs then w freqs
        emb = torch.cat((emb, emb), dim=-1).view(n // unit, unit, -1)[window_index].reshape(n, -1)
        cos, sin = emb.cos(), emb.sin()
        window_groups = _segment_groups(windows, device)
        frame_groups = _segment_groups(frames, device)
        for i, block in enumerate(self.blocks):
            groups = frame_groups if i in self.fullatt_block_indexes else window_groups
            x = block(x, cos, sin, groups)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[window_index] = merged
        return out

    def split_by_image(self, embeds: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Forward's output as one `[t*h*w / merge**2, out_hidden_size]` tensor per image."""
        sizes = (grid_thw.prod(-1) // self.merge**2).tolist()
        return list(embeds.split(sizes))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (prefix removed); unknown names or shapes raise ValueError
        before anything is copied. Returns the names loaded."""
        params = dict(self.named_parameters())
        items = list(weights)
        unknown = sorted(name for name, _ in items if name not in params)
        if unknown:
            raise ValueError(f"unknown Qwen2.5-VL vision weights: {unknown}")
        for name, tensor in items:
            shape = params[name].shape
            # the only reshape allowed: the 5-D Conv3d kernel into the 2-D patch matmul
            conv = name == "patch_embed.proj.weight" and tensor.numel() == shape.numel()
            if tensor.shape != shape and not conv:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(shape)}")
        with torch.no_grad():
            for name, tensor in items:
                param = params[name]
                param.copy_(tensor.reshape(param.shape).to(param.dtype))
        return {name for name, _ in items}
