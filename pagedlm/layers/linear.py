"""Linear layers with vLLM's names; fused QKV and gate/up projections load from separate shards.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies this
rank's part of a checkpoint tensor into the right rows. Under tensor parallelism,
column-parallel layers hold a slice of the output rows and row-parallel layers a slice of the
input columns, followed by an all-reduce (vLLM's Megatron-style split).
How a layer holds its weight and computes is its `quant_method` (layers/quantization): the
unquantized method adds, after loading, the platform's prepacked layout (oneDNN on CPU) and
the small-batch kernel's copy, and computes with `linear`; GGUF and int8 methods keep
quantized weights. From `process_weights_after_loading` on the weights are final.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedlm.kernels import cpu as cpu_kernels
from pagedlm.platforms import current_platform


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ b). With a prepacked copy (CPU): decode-sized batches go to the small-batch
    kernel where it is the faster (AMX over the dense weight, or AVX-512 BF16 over its blocked
    copy or, up to 2 rows, a tied head's dense table), the rest to oneDNN. `weight` itself
    may be the prepacked layout."""
    if packed is not None:
        y = cpu_kernels.small_batch_linear(x, weight, bias)
        if y is not None:
            return y
        weight = packed
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepack_weight(module: nn.Module) -> torch.Tensor | None:
    """Prepack `module.weight` for `linear`; returns the copy to pass as `packed`, or None.

    Where the platform has a small-batch kernel, `module.weight` becomes the layout that kernel
    reads (the dense weight for AMX and AVX2, a blocked copy for AVX-512 BF16) and the copy for
    larger batches is returned: the prepacked one, or the dense weight where oneDNN has no
    prepacked bf16 layout (AVX2). Otherwise the prepacked layout, if any, replaces
    `module.weight` (and None is returned).
    """
    weight = module.weight.data
    packed = current_platform.prepack_linear_weight(weight)
    if packed is None and not current_platform.reads_dense_weight(weight):
        return None  # nothing prepacked: no second copy next to the dense weight either
    small = current_platform.small_batch_weight(weight)
    if small is None:
        if packed is not None:
            module.weight = nn.Parameter(packed, requires_grad=False)
        return None
    if small is not weight:
        module.weight = nn.Parameter(small, requires_grad=False)
    return packed if packed is not None else weight


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x W^T (+ b); weights stored [output_size, input_size] (this rank's shard)."""

    # Values per activation scale in the W8A8 per-channel GEMMs (AMX-INT8, AVX-512 VNNI; the
    # GEMV takes 32): the coarsest this layer's input takes within the quality bounds (fewer
    # scales: faster); None = once per token. See MergedColumnParallelLinear and
    # RowParallelLinear.
    activation_block: int | None = 128

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = torch.get_default_dtype()
        from pagedlm.layers.quantization import get_linear_method

        self.quant_method = get_linear_method()  # creates self.weight (and its loader)
        self.quant_method.create_weights(self)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        default_weight_loader(param, loaded_weight)

    def shard_ids(self) -> tuple[object, ...]:
        """The `shard_id`s whose loads together fill the weight: None (one checkpoint
        tensor); fused layers name their parts."""
        return (None,)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output rows split over ranks: rank r holds rows [r * out / tp, (r + 1) * out / tp).
    The output stays split (the next row-parallel layer consumes it)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(input_size, divide(output_size, tp_size), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        rows = param.shape[0]
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * rows, rows))


class RowParallelLinear(LinearBase):
    """Input columns split over ranks; partial products are summed (all-reduce), then the
    bias, held whole by every rank, is added once.

    `activation_block`: the MLP's down projection takes 256 (on the default model, top-1
    agreement with bf16 over 10.9k positions 97.50-97.56% against 97.54% per 128, per token
    97.14%; its AMX GEMM 1.1-1.3x faster than per 128); o_proj keeps 128.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, activation_block: int = 128
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.activation_block = activation_block
        super().__init__(divide(input_size, tp_size), output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.dim() == 2:
            cols = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * cols, cols)
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = tensor_model_parallel_all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input stacked on the output dim (gate_proj + up_proj);
    each is split over ranks, so a rank holds [gate shard | up shard].

    Its input (the MLP's, after the norm) takes W8A8 activations per token: on the default
    model that measured +0.13% perplexity against bf16 (+0.22% per 128 values); per token on
    qkv's input costs 0.3-0.4 points more (docs/performance.md, Quality).
    """

    activation_block = None

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.output_sizes = [divide(size, tp_size) for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias)

    def shard_ids(self) -> tuple[object, ...]:
        return tuple(range(len(self.output_sizes)))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of [gate | up] = this layer's output, where its method computes it
        in one pass (`apply_silu_and_mul`: per-channel int8 on AMX-INT8 or AVX-512 VNNI); None
        elsewhere, and while forward hooks (LoRA) read the layer's output."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            return None
        if self._forward_hooks or self._forward_pre_hooks:
            return None
        return self.quant_method.apply_silu_and_mul(self, x, self.bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        assert isinstance(shard_id, int)
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; output is [q | k | v] of this rank's heads.

    Query heads split evenly; KV heads too when there are at least as many as ranks, else
    each KV head is replicated on tp / total_num_kv_heads consecutive ranks (as vLLM does).
    `num_heads` / `num_kv_heads` are this rank's counts.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size)
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        else:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias)

    def shard_ids(self) -> tuple[object, ...]:
        return ("q", "k", "v")

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        offsets = {  # shard -> (offset in this rank's param, size, start in the checkpoint)
            "q": (0, self.q_size, self.tp_rank * self.q_size),
            "k": (self.q_size, self.kv_size, kv_rank * self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size, kv_rank * self.kv_size),
        }
        offset, size, start = offsets[shard_id]  # type: ignore[index]
        default_weight_loader(
            param.data.narrow(0, offset, size), loaded_weight.narrow(0, start, size)
        )
