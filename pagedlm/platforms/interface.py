"""What every device platform provides to the engine."""

from __future__ import annotations

import random

import numpy as np
import torch

from pagedlm.utils import huge_page_zeros


class Platform:
    """Device facts and policies; subclasses override what differs per device."""

    device_type: str = "cpu"
    dist_backend: str = "gloo"  # torch.distributed backend between ranks
    # Row chunk for dense blocks (the MLP) on long inputs, so the intermediate activations stay
    # in cache; None runs all rows at once.
    dense_chunk_rows: int | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    # vLLM's platform predicates (scripts and tests branch on them)
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def get_device_name(self, device_id: int = 0) -> str:
        return self.device_type

    def get_device_total_memory(self, device_id: int = 0) -> int:
        """vLLM's name for `total_memory_bytes` (bytes of RAM on a CPU)."""
        return self.total_memory_bytes()

    def supports_fp8(self) -> bool:
        """fp8 compute, as vLLM asks it (an fp8 KV cache is stored, not computed in fp8)."""
        return False

    def supports_bf16(self) -> bool:
        return True

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """dtype="auto": keep fp32 checkpoints in fp32, else bf16 where native, else fp32."""
        if checkpoint_dtype == torch.float32:
            return torch.float32
        return torch.bfloat16 if self.supports_bf16() else torch.float32

    def setup_threads(self, cpu_ids: list[int] | None = None) -> None:
        """Called before the model is built; a worker process passes the CPUs it owns."""

    def kv_cache_budget_bytes(self, utilization: float, model_bytes: int) -> int:
        """Bytes the KV cache may use when `kv_cache_memory_bytes` is not given: `utilization`
        of the device's memory less what is in use (`model_bytes`: what this engine's model
        took when it was loaded)."""
        raise NotImplementedError

    def memory_in_use_bytes(self) -> int:
        """Memory this process holds on the device (the RSS on a CPU)."""
        raise NotImplementedError

    def total_memory_bytes(self) -> int:
        raise NotImplementedError

    def zeros_lazy(
        self, shape: tuple[int, ...], dtype: torch.dtype, parts: int = 1
    ) -> torch.Tensor:
        """A zero host tensor whose pages are mapped when first written, in huge pages past
        the first 2 MiB of each of its `parts` ranges (`utils.huge_page_zeros`)."""
        return huge_page_zeros(shape, dtype, parts)

    def prepack_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A device-specific layout of an [out, in] weight that `layers.linear.linear` accepts,
        or None to keep the dense weight."""
        return None

    def small_batch_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The layout of an [out, in] weight a small-batch kernel reads next to the prepacked
        one (the dense weight itself, or a kernel-specific copy), or None."""
        return None

    def reads_dense_weight(self, weight: torch.Tensor) -> bool:
        """Whether a small-batch kernel needs the dense weight next to the prepacked one."""
        return False

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    @staticmethod
    def seed_everything(seed: int | None) -> None:
        if seed is None:
            return
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
