"""The batched LoRA apply against its dense formula: per-token slots (base rows untouched),
fused slices with block-diagonal B, absent slices, row chunks (the hook's running offset),
and no hook left after the step."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.layers.linear import MergedColumnParallelLinear
from pagedlm.lora.layers import LoRAStepMapping, activate, find_lora_layers


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Module()
    mlp.gate_up_proj = MergedColumnParallelLinear(8, [6, 6])
    with torch.no_grad():
        mlp.gate_up_proj.weight.normal_()
    mlp.gate_up_proj.process_weights_after_loading()
    return mlp


def test_grouped_lora_equals_dense_formula() -> None:
    mlp = _mlp()
    layers = find_lora_layers(mlp)
    assert list(layers) == ["gate_up_proj"]
    layer = layers["gate_up_proj"]
    assert [s.name for s in layer.slices] == ["gate_proj", "up_proj"]
    layer.allocate(max_loras=2, r_max=4, dtype=torch.float32, device="cpu")
    # slot 0: both slices, rank 4 and 2; slot 1: up_proj only, rank 3
    w0 = [(torch.randn(4, 8), torch.randn(6, 4)), (torch.randn(2, 8), torch.randn(6, 2))]
    w1 = [None, (torch.randn(3, 8), torch.randn(6, 3))]
    layer.set_slot(0, w0)
    layer.set_slot(1, w1)

    def delta(weights, row):
        parts = [torch.zeros(6) if w is None else (row @ w[0].t()) @ w[1].t() for w in weights]
        return torch.cat(parts)

    x = torch.randn(5, 8)
    slots = torch.tensor([-1, 0, 1, 0, -1])
    base = mlp.gate_up_proj(x)
    want = base.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[i] += delta([w0, w1][s], x[i])
    mapping = LoRAStepMapping(slots)
    with activate(layers, mapping):
        whole = mlp.gate_up_proj(x)
        chunked = torch.cat([mlp.gate_up_proj(x[:3]), mlp.gate_up_proj(x[3:])])
    torch.testing.assert_close(whole, want)
    torch.testing.assert_close(chunked, want)
    torch.testing.assert_close(mlp.gate_up_proj(x), base)  # hooks removed
    with activate(layers, LoRAStepMapping(torch.tensor([1, 1, 1, 1, 1]))):  # one slot, all rows
        every = mlp.gate_up_proj(x)
    torch.testing.assert_close(every, base + torch.stack([delta(w1, r) for r in x]))
