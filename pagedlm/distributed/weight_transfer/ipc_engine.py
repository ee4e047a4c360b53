"""The "ipc" backend: the trainer packs named tensors into a shared-memory file (/dev/shm)
and hands each worker its path and offsets; every worker maps the same pages (no copy over a
pipe), loads, and unmaps. In-process tensors are accepted as handles too (same process only).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedlm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    dtype_name,
)

_ALIGN = 64


@dataclass
class IPCWeightTransferInitInfo(WeightTransferInitInfo):
    """No initialization needed for IPC."""


@dataclass
class IPCWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """`ipc_handles[i]`: {"path": shared-memory file, "offset": byte offset} of tensor i
    (or the tensor itself, when the trainer shares the engine's process)."""

    ipc_handles: list[Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ipc_handles is None or len(self.ipc_handles) != len(self.names):
            got = None if self.ipc_handles is None else len(self.ipc_handles)
            raise ValueError(
                f"`ipc_handles` should have one handle per name: got {got} for "
                f"{len(self.names)} names."
            )


@dataclass
class IPCTrainerSendWeightsArgs:
    """`llm_handle`: the `LLM` to update (the trainer shares its machine)."""

    llm_handle: Any
    mode: str = "llm"

    def __post_init__(self) -> None:
        if self.mode != "llm":
            raise ValueError(f"mode must be 'llm' on pagedlm (no Ray/HTTP), got {self.mode!r}")
        if self.llm_handle is None:
            raise ValueError("llm_handle (the LLM to update) is required")


def _shared_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _map(path: str, nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def pack_shared(
    weights: list[tuple[str, torch.Tensor]],
) -> tuple[IPCWeightTransferUpdateInfo, str]:
    """Copy tensors into one new shared-memory file; returns the update info and the file's
    path (the caller deletes it once every worker has loaded)."""
    offsets, total = [], 0
    for _, tensor in weights:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    fd, path = tempfile.mkstemp(prefix="pagedlm-weights-", dir=_shared_dir())
    try:
        os.ftruncate(fd, max(total, 1))
    finally:
        os.close(fd)
    buffer = _map(path, max(total, 1))
    for (_, tensor), offset in zip(weights, offsets, strict=True):
        t = tensor.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        buffer[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t)
    del buffer
    info = IPCWeightTransferUpdateInfo(
        names=[n for n, _ in weights],
        dtype_names=[dtype_name(t.dtype) for _, t in weights],
        shapes=[list(t.shape) for _, t in weights],
        ipc_handles=[{"path": path, "offset": o} for o in offsets],
    )
    return info, path


class IPCWeightTransferEngine(WeightTransferEngine):
    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = IPCWeightTransferUpdateInfo

    def init_transfer_engine(self, init_info: WeightTransferInitInfo) -> None:
        """Nothing to connect."""

    def receive_weights(
        self,
        update_info: WeightTransferUpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
    ) -> None:
        assert isinstance(update_info, IPCWeightTransferUpdateInfo)
        assert update_info.ipc_handles is not None
        maps: dict[str, torch.Tensor] = {}
        weights = []
        for name, dtype, shape, handle in zip(
            update_info.names,
            update_info.dtypes(),
            update_info.shapes,
            update_info.ipc_handles,
            strict=True,
        ):
            weights.append((name, self._open(name, dtype, shape, handle, maps)))
        try:
            load_weights(weights)
        finally:
            weights.clear()
            maps.clear()

    @staticmethod
    def _open(
        name: str, dtype: torch.dtype, shape: list[int], handle: Any, maps: dict
    ) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            if handle.dtype != dtype or list(handle.shape) != list(shape):
                raise ValueError(
                    f"weight {name!r}: the tensor is {handle.dtype} {list(handle.shape)}, the "
                    f"update declares {dtype} {list(shape)} (nothing was loaded)."
                )
            return handle
        if not isinstance(handle, dict) or not {"path", "offset"} <= handle.keys():
            raise ValueError(
                f"weight {name!r}: an IPC handle is {{'path', 'offset'}}, got {handle!r}."
            )
        path, offset = handle["path"], int(handle["offset"])
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if path not in maps:
            try:
                size = os.path.getsize(path)
            except OSError as e:
                raise ValueError(f"weight {name!r}: shared-memory file {path!r}: {e}") from e
            maps[path] = _map(path, size)
        buffer = maps[path]
        if offset < 0 or offset + nbytes > buffer.numel():
            raise ValueError(
                f"weight {name!r}: {nbytes} bytes at offset {offset} run past the end of "
                f"{path!r} ({buffer.numel()} bytes); shape or dtype do not match the handle."
            )
        return buffer[offset : offset + nbytes].view(dtype).view(shape)

    def shutdown(self) -> None:
        """Nothing held between updates."""

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]],
        trainer_args: dict[str, Any] | IPCTrainerSendWeightsArgs,
    ) -> None:
        """Pack the weights into shared memory and call `llm.update_weights` with the handles
        (between the caller's `start_weight_update` and `finish_weight_update`)."""
        args = (
            IPCTrainerSendWeightsArgs(**trainer_args)
            if isinstance(trainer_args, dict)
            else trainer_args
        )
        info, path = pack_shared(list(iterator))
        try:
            args.llm_handle.update_weights({"update_info": asdict(info)})
        finally:
            os.unlink(path)
