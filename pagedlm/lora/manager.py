"""The worker's LoRA manager: `max_loras` slots in the model's LoRA layers, and an LRU cache
of up to `max_cpu_loras` loaded adapters in host memory.

Invariants:
- every adapter in a slot is in the host cache; a slot's tensors hold exactly its adapter;
- the host cache never holds more than `max_cpu_loras` adapters: adding one evicts the least
  recently used unpinned adapter (and frees its slot); pinned adapters are never evicted
  from the host cache (slots are reassigned as steps need them, unpinned ones first);
- a step's adapters (at most `max_loras`, the scheduler's guarantee) are all in slots when
  `prepare_step` returns; an adapter not cached any more is loaded again from its path.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedlm.config import LoRAConfig
from pagedlm.lora.adapter import LoRAModel, load_lora_model
from pagedlm.lora.layers import LoRALayer, LoRAStepMapping, find_lora_layers
from pagedlm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class WorkerLoRAManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.layers: dict[str, LoRALayer] = find_lora_layers(model)
        if not self.layers:
            raise NotImplementedError(
                f"enable_lora=True: {type(model).__name__} has no layers LoRA can target "
                "(q/k/v/o/gate/up/down projections); LoRA is not supported for this model."
            )
        for layer in self.layers.values():
            layer.allocate(config.max_loras, config.max_lora_rank, dtype, device)
        self.cache: OrderedDict[int, LoRAModel] = OrderedDict()  # LRU first
        self.pinned: set[int] = set()
        self.slots: list[int | None] = [None] * config.max_loras
        self.slot_lru: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first

    # ------------------------------------------------------------------ cache
    def add_adapter(self, request: LoRARequest, keep: frozenset[int] = frozenset()) -> bool:
        """Load (and validate) the adapter into the host cache; True if it was loaded now.
        With `load_inplace` a cached adapter of that id is read again (and its slot rewritten)."""
        lora_id = request.lora_int_id
        if lora_id in self.cache and not request.load_inplace:
            self.cache.move_to_end(lora_id)
            return False
        model = load_lora_model(request, self.layers, self.config.max_lora_rank, self.dtype)
        if lora_id in self.cache:  # load_inplace
            self.cache[lora_id] = model
            self.cache.move_to_end(lora_id)
            slot = self.slot_lru.get(lora_id)
            if slot is not None:
                for name, layer in self.layers.items():
                    layer.set_slot(slot, model.weights.get(name))
            return True
        self._make_room(keep)
        self.cache[request.lora_int_id] = model
        return True

    def _make_room(self, keep: frozenset[int]) -> None:
        """Evict LRU unpinned adapters (not in `keep`: this step's) until one more fits."""
        capacity = self.config.max_cpu_loras
        assert capacity is not None
        while len(self.cache) >= capacity:
            victim = next((i for i in self.cache if i not in self.pinned and i not in keep), None)
            if victim is None:
                raise RuntimeError(
                    f"No room for another LoRA adapter: the {capacity} cached adapters are "
                    "pinned or in use; remove_lora() one or raise max_cpu_loras."
                )
            self.remove_adapter(victim)

    def remove_adapter(self, lora_int_id: int) -> bool:
        self.pinned.discard(lora_int_id)
        slot = self.slot_lru.pop(lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None
        return self.cache.pop(lora_int_id, None) is not None

    def list_adapters(self) -> set[int]:
        return set(self.cache)

    def pin_adapter(self, lora_int_id: int) -> bool:
        if lora_int_id not in self.cache:
            raise ValueError(f"Pinning failed. LoRA {lora_int_id} is not registered.")
        self.pinned.add(lora_int_id)
        return True

    # ------------------------------------------------------------------ slots
    def _slot_for(self, lora_int_id: int, needed: set[int]) -> int:
        if lora_int_id in self.slot_lru:
            self.slot_lru.move_to_end(lora_int_id)
            return self.slot_lru[lora_int_id]
        if None in self.slots:
            slot = self.slots.index(None)
        else:  # evict the least recently used slot this step does not need, unpinned first
            candidates = [i for i in self.slot_lru if i not in needed]
            assert candidates, "more adapters in one step than max_loras"
            victim = next((i for i in candidates if i not in self.pinned), candidates[0])
            slot = self.slot_lru.pop(victim)
        self.slots[slot] = lora_int_id
        self.slot_lru[lora_int_id] = slot
        model = self.cache[lora_int_id]
        for name, layer in self.layers.items():
            layer.set_slot(slot, model.weights.get(name))
        return slot

    def prepare_step(
        self, token_lora_ids: np.ndarray, requests: dict[int, LoRARequest]
    ) -> LoRAStepMapping | None:
        """Put the step's adapters in slots; the per-token slot mapping (None: no adapter)."""
        distinct = np.unique(token_lora_ids)  # sorted
        ids = [int(i) for i in distinct if i > 0]
        if not ids:
            return None
        if len(ids) > self.config.max_loras:
            raise RuntimeError(
                f"{len(ids)} LoRA adapters in one step, more than max_loras="
                f"{self.config.max_loras}; this is a scheduler bug in pagedlm."
            )
        needed = set(ids)
        slot_of = np.full(len(distinct), -1, dtype=np.int64)  # by position in `distinct`
        for i, lora_id in enumerate(distinct.tolist()):
            if lora_id <= 0:
                continue
            if lora_id not in self.cache:
                self.add_adapter(requests[lora_id], frozenset(needed))
            else:
                self.cache.move_to_end(lora_id)
            slot_of[i] = self._slot_for(lora_id, needed)
        token_slots = slot_of[np.searchsorted(distinct, token_lora_ids)]
        token_slots = torch.from_numpy(token_slots).to(self.device)
        return LoRAStepMapping(token_slots)
