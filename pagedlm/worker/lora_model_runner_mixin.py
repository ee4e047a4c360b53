"""The worker side of LoRA: the control calls `collective_rpc` reaches by name (`add_lora`,
`remove_lora`, `list_loras`, `pin_lora`), and the per-step slot mapping of the model runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pagedlm.lora.layers import LoRAStepMapping
from pagedlm.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedlm.lora.manager import WorkerLoRAManager
    from pagedlm.worker.input_batch import InputBatch
    from pagedlm.worker.step_inputs import StepInputs


def lora_step_mapping(
    manager: WorkerLoRAManager, batch: InputBatch, inputs: StepInputs
) -> LoRAStepMapping | None:
    """Slots for this step's adapters and each token's slot (None: no request uses one)."""
    lora_ids = batch.lora_id[inputs.rows]
    if not lora_ids.any():
        return None
    token_lora_ids = np.repeat(lora_ids, np.diff(inputs.attn.query_start_loc))
    requests = {s.lora_request.lora_int_id: s.lora_request for s in inputs.states if s.lora_request}
    return manager.prepare_step(token_lora_ids, requests)


class WorkerLoRAMixin:
    """Mixed into Worker; expects `model_runner` (whose `lora_manager` is set with LoRA)."""

    model_runner: Any

    def _lora_manager(self) -> WorkerLoRAManager:
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise ValueError("LoRA is not enabled; pass LLM(..., enable_lora=True).")
        return manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora_manager().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove_adapter(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora_manager().list_adapters()

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora_manager().pin_adapter(lora_id)
