"""RMSNorm with an optional fused residual add; the math runs in fp32 like Hugging Face."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.kernels import cpu as cpu_kernels
from pagedlm.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    """`forward(x)` -> normed; `forward(x, residual)` -> (normed(x + residual), x + residual).

    `offset=1.0` gives Gemma's `(1 + weight)` scaling. On the CPU the C kernel does the add and
    the norm in one pass and writes x + residual into `residual` (vLLM's fused_add_rms_norm).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = lambda p, w, shard_id=None: default_weight_loader(p, w)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:  # Gemma multiplies in fp32 before casting back
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        lib = cpu_kernels.kernels_for(x, self.weight)
        if lib is not None:
            out = cpu_kernels.rms_norm(lib, x, residual, self.weight, self.eps, self.offset)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
