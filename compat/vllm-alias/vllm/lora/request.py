"""vllm.lora.request -> pagedlm.lora.request (the same LoRARequest class)."""

from pagedlm.lora.request import LoRARequest  # noqa: F401
