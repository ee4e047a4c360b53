"""Int8 weight-only linear method: per-output-channel symmetric int8, for bf16/fp32 checkpoints.

After the dense weight is loaded: scale[n] = max_k |W[n, k]| / 127, q = round(W / scale)
(clamped to [-127, 127]); y = x (q * scale)^T through torch's `_weight_int8pack_mm` (x in
bf16/fp32), or dequantize-then-matmul for other dtypes. The dense weight is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.layers.quantization.base import LinearMethodBase, create_dense_weight


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 q [N, K], fp32 scale [N]); all-zero rows get scale 1."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8WeightOnlyLinearMethod(LinearMethodBase):
    def create_weights(self, layer: nn.Module) -> None:
        create_dense_weight(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_per_channel(layer.weight.data)
        layer.weight = None
        layer.int8_weight = q
        layer.int8_scales = scale.to(layer.params_dtype)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype in (torch.bfloat16, torch.float32):
            scales = layer.int8_scales.to(x2.dtype)
            y = torch._weight_int8pack_mm(x2.contiguous(), layer.int8_weight, scales)
            if bias is not None:
                y = y + bias
        else:
            w = layer.int8_weight.to(x2.dtype) * layer.int8_scales.to(x2.dtype)[:, None]
            y = F.linear(x2, w, bias)
        return y.view(*x.shape[:-1], y.shape[-1])
