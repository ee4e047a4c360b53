"""LoRARequest: vLLM's description of a LoRA adapter (name, int id, path of a PEFT adapter
directory). With `LLM(..., enable_lora=True)` a request carrying one runs with that adapter;
it is plain data (sent to the workers inside `NewRequestData`, which load the adapter).
`lora_int_id` identifies the adapter (one id, one adapter); `load_inplace=True` makes
`add_lora` read the files again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __hash__(self) -> int:
        return hash(self.lora_name)
