"""The linear-method interface and the unquantized method."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedlm.layers.linear import linear, prepack_weight


class LinearMethodBase:
    """Owns a layer's weight: creates the parameters the checkpoint loads into, turns them into
    the compute layout after loading, and computes y = x W^T (+ bias).

    The layer provides `input_size`, `output_size` (this rank's), `params_dtype` and
    `weight_loader(param, loaded_weight, shard_id)` (its tensor-parallel slicing).
    """

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """silu(gate) * up of `apply`'s [gate | up] in one pass, or None where this method
        has no such pass (the caller then runs `apply` and the activation)."""
        return None


def create_dense_weight(layer: nn.Module, allocate: Callable = torch.empty) -> None:
    """`layer.weight`: an [output_size, input_size] parameter loaded by `layer.weight_loader`,
    allocated by `allocate(shape, dtype)`."""
    weight = allocate((layer.output_size, layer.input_size), dtype=layer.params_dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight.weight_loader = layer.weight_loader


class UnquantizedLinearMethod(LinearMethodBase):
    """Dense weight; after loading the platform's prepacked layout (oneDNN) and, where a
    small-batch kernel runs, its own copy for decode batches (see `linear`)."""

    def create_weights(self, layer: nn.Module) -> None:
        create_dense_weight(layer)
        layer.packed_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight = prepack_weight(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.packed_weight)
