"""Weight-transfer engines: how a trainer's named tensors reach every worker (vLLM's design).

A worker owns one `WeightTransferEngine`, made by the backend registry from
`WeightTransferConfig(backend=...)`. The trainer side is static (`trainer_init`,
`trainer_send_weights`) and runs in the trainer's process. Every update carries `names`,
`dtype_names` and `shapes` (whole, unsharded checkpoint tensors); the engine receives every
tensor of the update, then loads them into the model in one all-or-nothing
`load_weights` call, so a bad update raises and leaves the old weights serving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pagedlm.config import VllmConfig, WeightTransferConfig


@dataclass
class WeightTransferInitInfo:
    """Backend-specific initialization info (base)."""


@dataclass
class WeightTransferUpdateInfo:
    """Backend-specific update info: the tensors' names, dtype names and shapes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(
                f"update_info needs one dtype name and one shape per name: got {n} names, "
                f"{len(self.dtype_names)} dtype_names and {len(self.shapes)} shapes."
            )
        for name, dtype_name, shape in zip(self.names, self.dtype_names, self.shapes, strict=True):
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(
                    f"weight {name!r}: dtype name {dtype_name!r} is not a floating-point torch "
                    "dtype (e.g. 'float32', 'bfloat16')."
                )
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"weight {name!r}: shape {shape!r} is not a list of sizes.")

    def dtypes(self) -> list[torch.dtype]:
        return [getattr(torch, d) for d in self.dtype_names]


@dataclass
class WeightTransferInitRequest:
    """API-level init request: `init_info` is the backend's init-info dict."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """API-level update request: `update_info` is the backend's update-info dict."""

    update_info: dict[str, Any] = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightTransferEngine(ABC):
    """Receives weights on one worker. Subclasses set `init_info_cls` / `update_info_cls`."""

    init_info_cls: ClassVar[type[WeightTransferInitInfo]]
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]]

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, rank: int) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.rank = rank  # this worker's rank within the engine (tensor parallel)

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightTransferInitInfo:
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

    def parse_update_info(self, update_dict: dict[str, Any]) -> WeightTransferUpdateInfo:
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {type(self).__name__}: {e}") from e

    @abstractmethod
    def init_transfer_engine(self, init_info: WeightTransferInitInfo) -> None:
        """Connect to the trainer (once)."""

    @abstractmethod
    def receive_weights(
        self,
        update_info: WeightTransferUpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
    ) -> None:
        """Receive every tensor of the update, then call `load_weights` once with all."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the connection to the trainer (idempotent)."""

    @staticmethod
    @abstractmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: dict[str, Any] | Any
    ) -> None:
        """Trainer side: send (name, tensor) pairs to the workers."""
