"""vllm.lora.request -> pagedlm.lora.request (pagedlm runs no LoRA yet)."""

from pagedlm.lora.request import LoRARequest  # noqa: F401
