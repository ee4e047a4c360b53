"""Int8 W8A8 linear methods: int8 weights with one scale per output channel, activations
quantized to int8 in the kernels, integer dot products (AMX-INT8, AVX-512 VNNI, AVX2, portable
C).

- `Int8LinearMethod` (quantization="int8"): a bf16/fp32 checkpoint's dense weight quantized at
  load: scale[n] = max_k |W[n, k]| / 127, q = round(W / scale) clamped to [-127, 127], as soon
  as its last shard is loaded, so only one layer's dense weight is held at a time. The LM
  head too (vocab_embedding.py); a tied embedding then reads rows from it
  (`gguf.PackedEmbeddingMethod`).
- `CompressedTensorsW8A8LinearMethod` (quantization="compressed-tensors"): a checkpoint that
  holds q (`weight`, int8) and the scales (`weight_scale`, [N, 1]) already.

Both keep only the packed copy (`kernels.gguf_pack.pack_q8`: Q8_0's tile layout, fp32 scales)
and compute as packed GGUF does (`PackedLinearMethod`): the activations are quantized
dynamically per 32 values (GEMV: decode-sized batches, every batch on AVX2), else per the
layer's `activation_block` (`LinearBase`: per token on gate/up, 256 on down, else 128; GEMM:
AMX-INT8 where it runs, else AVX-512 VNNI), mostly finer than vLLM's per token. Where
K is not a multiple of 64 the kernels do not apply: the layer keeps the dequantized weight
(q * scale) and computes with F.linear.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedlm.kernels.gguf_pack import can_pack, pack_q8
from pagedlm.layers.quantization.base import create_dense_weight
from pagedlm.layers.quantization.gguf import PackedGroup, PackedLinearMethod
from pagedlm.utils import huge_page_zeros


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 q [N, K], fp32 scale [N]); all-zero rows get scale 1. Rows go in
    chunks, so the fp32 temporaries stay small next to a large table (an LM head)."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n)
    step = max(1, (1 << 22) // max(k, 1))
    for r0 in range(0, n, step):
        w = weight[r0 : r0 + step].float()
        amax = w.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q[r0 : r0 + step] = torch.round(w / s[:, None]).clamp_(-127, 127)
        scale[r0 : r0 + step] = s
    return q, scale


class _Int8Method(PackedLinearMethod):
    """After loading `layer.packed_groups` is one group of all rows; `layer.weight` is None."""

    def _keep(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        n, k = q.shape
        scale = scale.float().reshape(n)
        if can_pack(GGMLQuantizationType.Q8_0, (n, k)):
            block = getattr(layer, "activation_block", 128)  # the LM head's: 128
            group = PackedGroup(0, n, pack_q8(q, scale, block), None)
        else:
            group = PackedGroup(0, n, None, (q.float() * scale[:, None]).to(layer.params_dtype))
        layer.weight = None
        layer.packed_groups = [group]


class Int8LinearMethod(_Int8Method):
    """The dense weight is quantized once every shard of it (`layer.shard_ids()`) is loaded;
    `process_weights_after_loading` quantizes what loading did not complete (dummy weights).

    The dense weight lies in its own anonymous mapping, so its pages go back to the OS the
    moment it is freed: from the malloc heap, tcmalloc kept every layer's freed rows resident
    until loading ended (3B shapes: peak RSS 9.4 -> 4.6 GB, steady 3.6)."""

    def create_weights(self, layer: nn.Module) -> None:
        create_dense_weight(layer, huge_page_zeros)
        pending = set(layer.shard_ids())

        def weight_loader(param, loaded_weight, shard_id=None) -> None:
            if shard_id is None:
                layer.weight_loader(param, loaded_weight)
            else:
                layer.weight_loader(param, loaded_weight, shard_id)
            pending.discard(shard_id)
            if not pending:
                self.process_weights_after_loading(layer)
                # the checkpoint loader's name -> parameter map still holds `param`: free its
                # rows now, not when loading ends
                param.data = torch.empty(0, dtype=param.dtype)

        layer.weight.weight_loader = weight_loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight is not None:
            self._keep(layer, *quantize_per_channel(layer.weight.data))


class CompressedTensorsW8A8LinearMethod(_Int8Method):
    """`weight` int8 [N, K] and `weight_scale` [N] (the checkpoint's [N, 1]), each loaded
    through the layer's tensor-parallel `weight_loader` (fused shards: their rows)."""

    def create_weights(self, layer: nn.Module) -> None:
        weight = torch.empty(layer.output_size, layer.input_size, dtype=torch.int8)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        scale = torch.empty(layer.output_size, dtype=torch.float32)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

        def scale_loader(param, loaded_weight, shard_id=None) -> None:
            loaded = loaded_weight.reshape(-1)  # [N, 1] -> [N]: rows, never columns
            if shard_id is None:
                layer.weight_loader(param, loaded)
            else:
                layer.weight_loader(param, loaded, shard_id)

        layer.weight_scale.weight_loader = scale_loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = layer.weight.data, layer.weight_scale.data
        del layer.weight_scale
        self._keep(layer, q, scale)
