"""The tensor-parallel group of this process and its collectives.

A process outside any multi-rank executor is rank 0 of a group of one: every collective is
then the identity, so layers call them unconditionally. Ranks of one group run the same
forward on the same inputs; they must call collectives in the same order.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place when possible."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (same shape on every rank)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenation along `dim` on rank `dst`; None on the other ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None


_TP = GroupCoordinator()


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, backend: str = "gloo"
) -> None:
    """Join the process group of all ranks; the tensor-parallel group spans all of them."""
    global _TP
    if world_size == 1:
        _TP = GroupCoordinator()
        return
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, init_method=init_method, world_size=world_size, rank=rank
        )
    _TP = GroupCoordinator(rank=rank, world_size=world_size, group=dist.group.WORLD)
    logger.info("rank %d of %d joined the %s group", rank, world_size, backend)


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(x, dim)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1):
    return _TP.gather(x, dst, dim)


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Leave the process group (if any) and collect garbage; vLLM tests call it after `del llm`.
    With `shutdown_ray`, also stop a local Ray runtime (as vLLM does)."""
    global _TP
    _TP = GroupCoordinator()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if shutdown_ray:
        try:
            import ray
        except ImportError:
            return
        ray.shutdown()
