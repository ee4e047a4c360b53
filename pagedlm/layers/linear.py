"""Linear layers with vLLM's names; fused QKV and gate/up projections load from separate shards.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies a
checkpoint tensor into the right rows. Tensor parallelism is size 1 for now: no sharding.
After loading, `process_weights_after_loading` adds the platform's prepacked layout (oneDNN on
CPU) and drops the dense weight unless the platform's small-batch kernel reads it; from then on
the weights are final and only `linear` reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.kernels import cpu as cpu_kernels
from pagedlm.platforms import current_platform


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ b). With a prepacked copy (CPU): decode-sized batches go to the AMX kernel over
    the dense weight, the rest to oneDNN. `weight` itself may be the prepacked layout."""
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

    The dense weight survives only where the platform's small-batch kernel reads it; otherwise
    the prepacked layout replaces `module.weight` (and None is returned).
    """
    weight = module.weight.data
    packed = current_platform.prepack_linear_weight(weight)
    if packed is None or current_platform.reads_dense_weight(weight):
        return packed
    module.weight = nn.Parameter(packed, requires_grad=False)
    return None


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x W^T (+ b); weights stored [output_size, input_size] as in checkpoints."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed_weight: torch.Tensor | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        default_weight_loader(param, loaded_weight)

    def process_weights_after_loading(self) -> None:
        self.packed_weight = prepack_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    pass


class RowParallelLinear(LinearBase):
    pass


class MergedColumnParallelLinear(LinearBase):
    """Several projections of the same input stacked on the output dim (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        assert isinstance(shard_id, int)
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one matmul; output is [q | k | v] along the last dim."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        self.head_size = head_size
        self.num_heads = total_num_heads
        self.num_kv_heads = total_num_kv_heads
        self.q_size = total_num_heads * head_size
        self.kv_size = total_num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        offsets = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        offset, size = offsets[shard_id]  # type: ignore[index]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)
