"""The "gloo" backend: a torch.distributed gloo group of the trainer (rank 0) and every
worker (ranks rank_offset + worker rank), outside the engine's own process group; updates
are broadcast from the trainer tensor by tensor.

Both sides block while connecting and while transferring: call `LLM.init_weight_transfer_
engine` / `LLM.update_weights` on a thread while the trainer runs `trainer_init` /
`trainer_send_weights` (as with vLLM's NCCL backend).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedlm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    packed: bool = False  # accepted for vLLM compatibility; tensors go one by one


@dataclass
class GlooTrainerSendWeightsArgs:
    group: Any
    src: int = 0


class GlooGroup:
    """A gloo group outside torch.distributed's default group (the engine's workers may
    have their own), with the TCP store it rendezvoused on (the trainer's hosts it)."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("pagedlm_weight_transfer", self.store)
        self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        self.rank, self.world_size = rank, world_size

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.group.broadcast(tensor, src).wait()


_group = GlooGroup


class GlooWeightTransferEngine(WeightTransferEngine):
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: GlooGroup | None = None

    def init_transfer_engine(self, init_info: WeightTransferInitInfo) -> None:
        assert isinstance(init_info, GlooWeightTransferInitInfo)
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_rank * parallel.world_size
        rank += self.rank
        if not 0 < rank < init_info.world_size:
            raise ValueError(
                f"worker rank {rank} in the weight-transfer group is outside 1..world_size-1 "
                f"(world_size={init_info.world_size}, rank_offset={init_info.rank_offset}); "
                "the trainer is rank 0 and the engine's workers follow it."
            )
        self.group = _group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )

    def receive_weights(
        self,
        update_info: WeightTransferUpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
    ) -> None:
        if self.group is None:
            raise RuntimeError(
                "gloo weight transfer not initialized: call init_weight_transfer_engine first."
            )
        weights = []
        for name, dtype, shape in zip(
            update_info.names, update_info.dtypes(), update_info.shapes, strict=True
        ):
            buffer = torch.empty(shape, dtype=dtype)
            self.group.broadcast(buffer, 0)
            weights.append((name, buffer))
        load_weights(weights)  # all received first: the trainer never waits on a failed load

    def shutdown(self) -> None:
        if self.group is not None:
            self.group = None

    @staticmethod
    def trainer_init(init_info: GlooWeightTransferInitInfo | dict[str, Any]) -> GlooGroup:
        """Join the group as rank 0 (the trainer) and return it; blocks until every worker
        joins (run `LLM.init_weight_transfer_engine` on another thread)."""
        if isinstance(init_info, dict):
            init_info = GlooWeightTransferInitInfo(**{"rank_offset": 1, **init_info})
        return _group(
            init_info.master_address,
            init_info.master_port,
            0,
            init_info.world_size,
            init_info.timeout_s,
        )

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]],
        trainer_args: dict[str, Any] | GlooTrainerSendWeightsArgs,
    ) -> None:
        """Broadcast each tensor, in the order of the update's names."""
        args = (
            GlooTrainerSendWeightsArgs(**trainer_args)
            if isinstance(trainer_args, dict)
            else trainer_args
        )
        for _, tensor in iterator:
            args.group.broadcast(tensor.detach().contiguous(), args.src)
