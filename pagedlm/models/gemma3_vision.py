"""Gemma 3's image encoder: the SigLIP vision tower and the Gemma 3 multimodal projector.

Input is what the Gemma 3 image processor returns: `pixel_values [n, 3, S, S]`, S the vision
config's `image_size` (already resized and normalized; pan-and-scan crops are just more rows).
Each image is encoded on its own: attention is bidirectional over that image's `(S/p)**2`
patches and never crosses images, so batching images changes nothing. The projector average-pools
the patch grid to `mm_tokens_per_image` tokens, applies Gemma's RMSNorm (`x * (1 + w)`, in fp32)
and projects to the text hidden size. Output `[n, mm_tokens_per_image, text_hidden_size]`: row
`i, j` is the embedding of image i's j-th `<image_soft_token>`. Compute runs in the weights' dtype.

Parameter names (the canonical names `load_weights` returns) are Hugging Face's 4.x checkpoint
names: `vision_tower.vision_model.{embeddings,encoder.layers.N,post_layernorm}.*` and
`multi_modal_projector.{mm_input_projection_weight,mm_soft_emb_norm.weight}`; `canonical_name`
maps the other spellings onto them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: Canonical names of this module's weights start with one of these (route checkpoint names
#: with `canonical_name(name).startswith(ENCODER_PREFIXES)`).
ENCODER_PREFIXES = ("vision_tower.", "multi_modal_projector.")

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def canonical_name(name: str) -> str:
    """A checkpoint / state-dict name spelled the way this module names its parameters.

    - a leading `model.` is removed (transformers >= 4.52 and 5.x nest everything under `model.`);
    - `vision_tower.X` without `vision_model.` becomes `vision_tower.vision_model.X`
      (transformers 5's SiglipVisionModel holds the transformer directly; 4.x had `vision_model`).
    So `model.vision_tower.embeddings.*` (5.x state dict), `model.vision_tower.vision_model.*`
    and `vision_tower.vision_model.*` (4.x hub checkpoints) all land on the same name.
    """
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


class _PatchEmbedding(nn.Module):
    """HF's Conv2d (kernel == stride == p, no padding) as one matmul over flattened patches.

    `weight` keeps the conv's shape `[D, C, p, p]`; patches are flattened (channel, row, col) to
    match it and come out row-major over the patch grid, as the conv's `flatten(2)` orders them.
    """

    def __init__(self, channels: int, dim: int, patch: int) -> None:
        super().__init__()
        self.patch = patch
        self.weight = nn.Parameter(torch.zeros(dim, channels, patch, patch))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        p = self.patch
        x = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = x.reshape(n, (h // p) * (w // p), c * p * p)
        return F.linear(x, self.weight.reshape(self.weight.shape[0], -1), self.bias)


class _Attention(nn.Module):
    """Multi-head self-attention with biased projections, no mask (all patches of one image)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"vision hidden_size {dim} not divisible by {heads} heads")
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:  # [n, L, D] -> [n, heads, L, D/heads]
            return t.view(n, length, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head_dim), as SigLIP
        return self.out_proj(out.transpose(1, 2).reshape(n, length, dim))


class _MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}")
        self.act = _ACTIVATIONS[act]
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        dim = vc.hidden_size
        self.layer_norm1 = nn.LayerNorm(dim, eps=vc.layer_norm_eps)
        self.self_attn = _Attention(dim, vc.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=vc.layer_norm_eps)
        self.mlp = _MLP(dim, vc.intermediate_size, vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _VisionTransformer(nn.Module):
    """SigLIP without the pooling head: [n, C, S, S] -> post-layernormed patches [n, P, D]."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = _PatchEmbedding(
            vc.num_channels, vc.hidden_size, vc.patch_size
        )
        num_patches = (vc.image_size // vc.patch_size) ** 2
        self.embeddings.position_embedding = nn.Embedding(num_patches, vc.hidden_size)
        self.encoder = nn.ModuleDict(
            {"layers": nn.ModuleList(_EncoderLayer(vc) for _ in range(vc.num_hidden_layers))}
        )
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings.patch_embedding(pixel_values)
        x = x + self.embeddings.position_embedding.weight
        for layer in self.encoder["layers"]:
            x = layer(x)
        return self.post_layernorm(x)


class _GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: `x / rms(x) * (1 + weight)` in fp32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class _Projector(nn.Module):
    """Patch grid [n, g*g, Dv] -> avg-pool k x k -> RMSNorm -> @ W [Dv, Dt] -> [n, T, Dt]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        self.patches_per_side = vc.image_size // vc.patch_size
        tokens_per_side = round(config.mm_tokens_per_image**0.5)
        if (
            tokens_per_side**2 != config.mm_tokens_per_image
            or self.patches_per_side % tokens_per_side
        ):
            raise ValueError(
                f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square whose side "
                f"divides the {self.patches_per_side}x{self.patches_per_side} patch grid"
            )
        self.kernel = self.patches_per_side // tokens_per_side
        dim_v, dim_t = vc.hidden_size, config.text_config.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(dim_v, dim_t))
        # HF normalizes with the *vision* config's layer_norm_eps here, not the text rms_norm_eps
        self.mm_soft_emb_norm = _GemmaRMSNorm(dim_v, vc.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, dim = x.shape
        g = self.patches_per_side
        grid = x.transpose(1, 2).reshape(n, dim, g, g)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)  # row-major tokens
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ImageEncoder(nn.Module):
    """`pixel_values [n, C, S, S]` -> `[n, mm_tokens_per_image, text_hidden_size]`.

    `config` is HF's `Gemma3Config` (its `vision_config` a `SiglipVisionConfig`). The SigLIP
    pooling head (`vision_use_head`) is never used by Gemma 3 and is not built.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        self.image_size = int(vc.image_size)
        self.num_channels = int(vc.num_channels)
        self.tokens_per_image = int(config.mm_tokens_per_image)
        self.vision_tower = nn.ModuleDict({"vision_model": _VisionTransformer(vc)})
        self.multi_modal_projector = _Projector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        want = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}, expected [n, *{want}]")
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        patches = self.vision_tower["vision_model"](pixel_values.to(dtype))
        return self.multi_modal_projector(patches)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (any spelling `canonical_name` accepts). The unused SigLIP
        pooling head (`vision_tower.vision_model.head.*`) is skipped; any other unknown name, or
        a shape mismatch, raises ValueError before anything is copied. Returns the canonical
        names loaded."""
        params = dict(self.named_parameters())
        head = "vision_tower.vision_model.head."
        items = [(canonical_name(n), t) for n, t in weights]
        items = [(n, t) for n, t in items if not n.startswith(head)]
        unknown = sorted(n for n, _ in items if n not in params)
        if unknown:
            raise ValueError(f"unknown Gemma 3 image encoder weights: {unknown}")
        for name, tensor in items:
            if tensor.shape != params[name].shape:
                shape = tuple(params[name].shape)
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {shape}")
        with torch.no_grad():
            for name, tensor in items:
                params[name].copy_(tensor.to(params[name].dtype))
        return {name for name, _ in items}
