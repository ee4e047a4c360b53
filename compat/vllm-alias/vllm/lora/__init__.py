"""vllm.lora."""

from vllm.lora import request  # noqa: F401
