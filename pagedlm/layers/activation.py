"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.kernels import cpu as cpu_kernels


class SiluAndMul(nn.Module):
    """x = [gate | up] -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = cpu_kernels.kernels_for(x)
        if lib is not None:
            return cpu_kernels.silu_and_mul(lib, x)
        d = x.shape[-1] // 2
        # a contiguous gate makes the element-wise silu much faster on CPU
        return F.silu(x[..., :d].contiguous(), inplace=True).mul_(x[..., d:])


class GeluAndMul(nn.Module):
    """x = [gate | up] -> gelu(gate) * up (tanh approximation by default, as Gemma)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def get_act_and_mul(name: str) -> nn.Module:
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"Unsupported activation {name!r}")
