"""CUDA platform: bf16 where the GPU has it; KV sized from free device memory."""

from __future__ import annotations

import torch

from pagedlm.platforms.interface import Platform


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"

    def supports_bf16(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if checkpoint_dtype == torch.float32:
            return torch.bfloat16 if self.supports_bf16() else torch.float16
        return super().default_dtype(checkpoint_dtype)

    def kv_cache_budget_bytes(self, utilization: float, model_bytes: int) -> int:
        free, total = torch.cuda.mem_get_info()  # the device's own count of what is used
        used = total - free
        return max(0, int(total * utilization) - used)

    def memory_in_use_bytes(self) -> int:
        return torch.cuda.memory_allocated()

    def total_memory_bytes(self) -> int:
        return torch.cuda.mem_get_info()[1]

    def zeros_lazy(
        self, shape: tuple[int, ...], dtype: torch.dtype, parts: int = 1
    ) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device="cuda")

    def synchronize(self) -> None:
        torch.cuda.synchronize()
