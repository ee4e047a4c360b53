"""LLMEngine's LoRA calls: checking a request's adapter, `add_lora` / `remove_lora` /
`list_loras` / `pin_lora` (sent to every rank through the executor), and the running/waiting
adapter names of the `vllm:lora_requests_info` metric. A part LLMEngine owns.

Invariant: an adapter a request carries has been loaded and validated by every rank before
the request is queued (`check_lora_request`), so a bad adapter fails at add time, naming
itself, and never reaches a step. One `lora_int_id` names one adapter (name and path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedlm.config import LoRAConfig
from pagedlm.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedlm.core.scheduler import Scheduler
    from pagedlm.executor.abstract import Executor


class LoRAAdapters:
    def __init__(
        self, lora_config: LoRAConfig | None, executor: Executor, scheduler: Scheduler
    ) -> None:
        self.lora_config = lora_config
        self.model_executor = executor
        self.scheduler = scheduler
        self._loras: dict[int, LoRARequest] = {}  # validated on every rank, by id

    def check_lora_request(self, lora_request: Any) -> LoRARequest | None:
        """The request's adapter, loaded and validated by the workers (ValueError if bad)."""
        if lora_request is None:
            return None
        if self.lora_config is None:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                "lora_request must be a pagedlm.lora.request.LoRARequest (vllm.lora.request."
                f"LoRARequest), got {type(lora_request).__name__}."
            )
        known = self._loras.get(lora_request.lora_int_id)
        if known is None:
            self.add_lora(lora_request)
        elif (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
            raise ValueError(
                f"lora_int_id {lora_request.lora_int_id} already names adapter "
                f"{known.lora_name!r} ({known.lora_path}); give {lora_request.lora_name!r} "
                "another lora_int_id, or remove_lora() the old one first."
            )
        return lora_request

    def _require_lora(self) -> None:
        if self.lora_config is None:
            raise ValueError("LoRA is not enabled; pass LLM(..., enable_lora=True).")

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter on every rank (host cache); False if it was already loaded.
        `load_inplace=True` reads it again (new weights; the prefix cache is invalidated)."""
        self._require_lora()
        known = self._loras.get(lora_request.lora_int_id)
        if (
            known is not None
            and known.lora_path != lora_request.lora_path
            and not lora_request.load_inplace
        ):
            raise ValueError(
                f"lora_int_id {lora_request.lora_int_id} already names adapter "
                f"{known.lora_name!r} ({known.lora_path}); remove_lora() it first."
            )
        loaded = self.model_executor.collective_rpc("add_lora", args=(lora_request,))
        self._loras[lora_request.lora_int_id] = lora_request
        if lora_request.load_inplace and known is not None:  # new weights under a known id
            self.scheduler.kv_cache_manager.invalidate_prefix_cache()
        return bool(loaded[0])

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the adapter from every rank; requests still running with it reload it."""
        self._require_lora()
        self._loras.pop(lora_id, None)
        return bool(self.model_executor.collective_rpc("remove_lora", args=(lora_id,))[0])

    def list_loras(self) -> set[int]:
        self._require_lora()
        return set(self.model_executor.collective_rpc("list_loras")[0])

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter in the workers' host cache (never evicted) until removed."""
        self._require_lora()
        return bool(self.model_executor.collective_rpc("pin_lora", args=(lora_id,))[0])

    def lora_stats(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting requests (sorted, distinct)."""

        def names(requests: Any) -> list[str]:
            return sorted({r.lora_request.lora_name for r in requests if r.lora_request})

        return names(self.scheduler.running), names(self.scheduler.waiting)
