"""LLM's RL weight transfer (vLLM's RL mixin): the trainer pushes new weights to every worker.

Weight-transfer calls go to every worker through `collective_rpc`, as in vLLM; a version
given to `finish_weight_update` (or `update_weight_version`) is what `get_weight_version`
reports from then on. After weights change the engine invalidates its prefix cache before
its next step (running requests go on with the KV they have).
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

from pagedlm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

if TYPE_CHECKING:
    from pagedlm.engine.llm_engine import LLMEngine


def _payload(request: Any, key: str, request_cls: type) -> dict[str, Any]:
    if isinstance(request, request_cls):
        value = getattr(request, key)
    elif isinstance(request, dict):
        if key not in request:
            raise ValueError(f"the request needs a {key!r} entry, got keys {sorted(request)}")
        value = request[key]
    else:
        raise TypeError(
            f"expected {request_cls.__name__} or a dict with {key!r}, got {type(request)}"
        )
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"{key} must be a dict, got {type(value).__name__}")
    return dict(value or {})


class WeightTransferMixin:
    llm_engine: LLMEngine

    def init_weight_transfer_engine(
        self, request: WeightTransferInitRequest | dict[str, Any]
    ) -> None:
        """Create each worker's transfer engine and connect it to the trainer."""
        init_info = _payload(request, "init_info", WeightTransferInitRequest)
        self.llm_engine.collective_rpc(
            "init_weight_transfer_engine", kwargs={"init_info": init_info}
        )

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.llm_engine.collective_rpc(
            "start_weight_update", kwargs={"is_checkpoint_format": is_checkpoint_format}
        )

    def update_weights(self, request: WeightTransferUpdateRequest | dict[str, Any]) -> None:
        """Receive one chunk of named tensors on every worker and load it (all or nothing)."""
        update_info = _payload(request, "update_info", WeightTransferUpdateRequest)
        self.llm_engine.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm_engine.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.llm_engine.set_weight_version(weight_version)

    def update_weight_version(self, new_version: str) -> None:
        """Set the reported version without touching the weights."""
        self.llm_engine.set_weight_version(new_version)

    def get_weight_version(self) -> str | None:
        """The latest committed weight version (None before any)."""
        return self.llm_engine.get_weight_version()

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm_engine.collective_rpc("shutdown_weight_transfer_engine")
