"""The batched LoRA apply: per-slot stacked A/B tensors on each target linear layer, and the
forward hooks that add `scale * (x A^T) B^T` to the layer's output for the tokens of each slot.

Invariants:
- a fused layer (qkv_proj, gate_up_proj) stacks its slices' LoRAs along the rank dim: slot
  tensors are A [max_loras, n_slices * r_max, in] and B [max_loras, out, n_slices * r_max],
  B block-diagonal (slice i's rows only read slice i's rank columns); a slice absent from an
  adapter, or ranks below r_max, are zeros. The scaling (alpha / r) is folded into B.
- tensor parallelism as vLLM shards it: column-parallel layers hold A whole and their rows
  of B; row-parallel layers hold their input columns of A and B whole, and the shrink
  (x A^T, a partial sum) is all-reduced before the expand.
- hooks exist only while a step that uses an adapter runs (`activate`); a step without any
  adapter runs the linear layers exactly as without LoRA.
- a layer may be called on consecutive row chunks of the step (the MLP chunks long
  prefills): each hook keeps its running offset into the step's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from pagedlm.distributed import tensor_model_parallel_all_reduce
from pagedlm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

# The PEFT target modules pagedlm runs, and the fused layer (and slice) each loads into.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PACKED_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass
class LoRASlice:
    """One PEFT target inside a (possibly fused) layer, as this rank holds it."""

    name: str  # the PEFT module name: q_proj, ...
    out_offset: int  # first row in this rank's layer output
    out_size: int  # rows this rank holds
    ckpt_start: int  # first of those rows in the adapter's (whole) B
    ckpt_rows: int  # rows of the adapter's whole B


class LoRALayer:
    """A target linear layer's LoRA slots; see the module docstring for the layout."""

    def __init__(self, name: str, module: LinearBase, slices: list[LoRASlice]) -> None:
        self.name = name
        self.module = module
        self.slices = slices
        tp_size = module.tp_size
        self.row_parallel = isinstance(module, RowParallelLinear)
        self.reduce_shrink = self.row_parallel and tp_size > 1
        self.in_size = module.input_size  # this rank's columns
        self.in_start = module.tp_rank * module.input_size if self.row_parallel else 0
        self.ckpt_cols = module.input_size * (tp_size if self.row_parallel else 1)
        self.a_stacked: torch.Tensor | None = None
        self.b_stacked: torch.Tensor | None = None
        self.r_max = 0

    def allocate(self, max_loras: int, r_max: int, dtype: torch.dtype, device) -> None:
        n = len(self.slices)
        self.r_max = r_max
        self.a_stacked = torch.zeros(max_loras, n * r_max, self.in_size, dtype=dtype, device=device)
        self.b_stacked = torch.zeros(
            max_loras, self.module.output_size, n * r_max, dtype=dtype, device=device
        )

    def set_slot(
        self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None] | None
    ) -> None:
        """Write one adapter's per-slice (A [r, in], B [out, r] already scaled) into `slot`."""
        assert self.a_stacked is not None and self.b_stacked is not None
        self.a_stacked[slot].zero_()
        self.b_stacked[slot].zero_()
        for i, (spec, pair) in enumerate(
            zip(self.slices, weights or [None] * len(self.slices), strict=True)
        ):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            cols = slice(i * self.r_max, i * self.r_max + r)
            self.a_stacked[slot, cols] = a
            self.b_stacked[slot, spec.out_offset : spec.out_offset + spec.out_size, cols] = b

    def add_delta(
        self, x: torch.Tensor, out: torch.Tensor, groups: list[tuple[int, torch.Tensor | None]]
    ) -> torch.Tensor:
        """out[idx] += (x[idx] A[slot]^T) B[slot]^T for each (slot, row indices) group (None:
        every row)."""
        a, b = self.a_stacked, self.b_stacked
        assert a is not None and b is not None
        x = x.to(a.dtype)
        shrunk = [
            (x if idx is None else x.index_select(0, idx)) @ a[slot].t() for slot, idx in groups
        ]
        if self.reduce_shrink:  # partial sums over this rank's input columns
            flat = tensor_model_parallel_all_reduce(torch.cat(shrunk))
            shrunk = list(flat.split([s.shape[0] for s in shrunk]))
        for (slot, idx), s in zip(groups, shrunk, strict=True):
            delta = (s @ b[slot].t()).to(out.dtype)
            if idx is None:
                out.add_(delta)
            else:
                out.index_add_(0, idx, delta)
        return out


def _slices(module: LinearBase, leaf: str) -> list[LoRASlice] | None:
    """This rank's slices of a target layer (None: not a layer LoRA can target)."""
    tp, rank = module.tp_size, module.tp_rank
    if isinstance(module, QKVParallelLinear):
        kv_rank = rank // module.num_kv_head_replicas
        kv_rows = module.kv_size * tp // module.num_kv_head_replicas
        q, kv = module.q_size, module.kv_size
        return [
            LoRASlice("q_proj", 0, q, rank * q, q * tp),
            LoRASlice("k_proj", q, kv, kv_rank * kv, kv_rows),
            LoRASlice("v_proj", q + kv, kv, kv_rank * kv, kv_rows),
        ]
    if isinstance(module, MergedColumnParallelLinear):
        names = PACKED_TARGETS.get(leaf)
        if names is None or len(names) != len(module.output_sizes):
            return None
        out = []
        for i, (name, size) in enumerate(zip(names, module.output_sizes, strict=True)):
            out.append(LoRASlice(name, sum(module.output_sizes[:i]), size, rank * size, size * tp))
        return out
    if leaf not in SUPPORTED_TARGETS:
        return None
    size = module.output_size
    if isinstance(module, ColumnParallelLinear):
        return [LoRASlice(leaf, 0, size, rank * size, size * tp)]
    return [LoRASlice(leaf, 0, size, 0, size)]  # row-parallel or replicated: rows whole


def find_lora_layers(model: nn.Module) -> dict[str, LoRALayer]:
    """Every linear layer of `model` a PEFT adapter can target, by module name."""
    layers: dict[str, LoRALayer] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        leaf = name.rpartition(".")[2]
        if leaf not in PACKED_TARGETS and leaf not in SUPPORTED_TARGETS:
            continue
        slices = _slices(module, leaf)
        if slices is not None:
            layers[name] = LoRALayer(name, module, slices)
    return layers


class LoRAStepMapping:
    """Which tokens of the step use which slot: `token_slots[t]` (-1: the base model)."""

    def __init__(self, token_slots: torch.Tensor) -> None:
        self.token_slots = token_slots
        self.num_tokens = int(token_slots.shape[0])
        self.groups = self.groups_for(0, self.num_tokens)
        assert self.num_tokens > 0

    def groups_for(self, start: int, num: int) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, row indices) per slot used in rows [start, start + num); indices None when
        the slot has every row."""
        slots = self.token_slots[start : start + num]
        distinct = torch.unique(slots).tolist()
        if len(distinct) == 1:
            return [(int(distinct[0]), None)] if distinct[0] >= 0 else []
        return [(int(slot), (slots == slot).nonzero().flatten()) for slot in distinct if slot >= 0]


@contextmanager
def activate(layers: dict[str, LoRALayer], mapping: LoRAStepMapping) -> Iterator[None]:
    """Hook every LoRA layer for one forward pass over the step's tokens."""
    offsets: dict[int, int] = {}

    def make_hook(layer: LoRALayer):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            x = args[0]
            num = x.shape[0]
            start = offsets.get(id(layer), 0)
            assert start + num <= mapping.num_tokens, "LoRA layer called on more rows than the step"
            offsets[id(layer)] = (start + num) % mapping.num_tokens
            if start == 0 and num == mapping.num_tokens:
                groups = mapping.groups
            else:
                groups = mapping.groups_for(start, num)
            if not groups:
                return output
            return layer.add_delta(x, output, groups)

        return hook

    handles = [layer.module.register_forward_hook(make_hook(layer)) for layer in layers.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
