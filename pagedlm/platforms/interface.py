"""What every device platform provides to the engine."""

from __future__ import annotations

import mmap
import random

import numpy as np
import torch

_HUGE_PAGE = 2 << 20  # x86-64 and most arm64 kernels' transparent huge page


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
        """A zero tensor in host memory whose pages the OS maps only when first written
        (anonymous mmap). Each of its `parts` equal ranges (a KV cache's K and V) keeps 4 KiB
        pages for its first huge page and is advised into transparent huge pages past it,
        where the kernel allows (THP "madvise" or "always"): a paged KV cache is read block by
        block all over its range, and with 4 KiB pages nearly every block is a TLB miss (decode
        attention over 24 layers of 8 x 4096 tokens: 1.84 -> 1.57 ms per layer), while a
        short context, whose blocks are the first ones handed out, maps only what it writes
        instead of a 2 MiB page per range of every layer (96 MB on the default model)."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            part = nbytes // parts
            for start in range(0, part * parts, part):
                begin = -(-(start + _HUGE_PAGE) // mmap.PAGESIZE) * mmap.PAGESIZE
                if begin >= start + part:
                    continue
                try:
                    buf.madvise(mmap.MADV_HUGEPAGE, begin, start + part - begin)
                except OSError:  # a kernel without THP: 4 KiB pages
                    break
        # the tensor keeps `buf` alive through the buffer protocol
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)

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
