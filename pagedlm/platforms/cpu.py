"""CPU platform: bf16 only with native AVX512-BF16/AMX, one thread per core, KV sized from RAM."""

from __future__ import annotations

import logging
import os

import psutil
import torch

from pagedlm import envs
from pagedlm.platforms.interface import Platform

logger = logging.getLogger(__name__)

_threads_set = False
# oneDNN picks its blocked weight layout for this many rows; 64 was best from 1 to 4096 rows.
_PREPACK_BATCH_HINT = 64
# Dense bf16 copies (for the small-batch kernel) are kept while the process stays under this.
_DENSE_COPY_RAM_FRACTION = 0.4
_DENSE_WEIGHT_ISAS = ("amx", "avx2")  # small-batch kernels that read the dense weight itself


def usable_cores() -> int:
    """Physical cores this process may run on (its affinity mask caps the count)."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    try:
        cores = min(cores, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this OS
        pass
    return max(1, cores)


class CpuPlatform(Platform):
    device_type = "cpu"
    # MLP rows per chunk, so that the gate/up output stays in cache: the default model's 64 x 128
    # prefill takes 10.6 s (packed GGUF) / 14.6 s (bf16) at 512, 11.3 / 15.0 at 128, 12.2 whole.
    # 1024 (tried for the int8 GEMM's non-temporal outputs): bf16 `long` at 0.5B 10% slower
    # (throughput.py, 1517-1535 against 1368-1397 tok/s), int8 `long` within noise at 0.5B/1.5B
    dense_chunk_rows = 512

    def supports_bf16(self) -> bool:
        cpu = torch.cpu
        amx = getattr(cpu, "_is_amx_tile_supported", lambda: False)()
        avx512_bf16 = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
        return bool(amx or avx512_bf16)

    def setup_threads(self, cpu_ids: list[int] | None = None) -> None:
        """One intra-op thread per physical core, set once; tokenizers stay single-threaded.

        A worker process of a multi-rank executor passes its `cpu_ids`: it is pinned to them
        and runs one thread per id.
        """
        global _threads_set
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if cpu_ids:
            os.sched_setaffinity(0, cpu_ids)
            torch.set_num_threads(len(cpu_ids))
            _threads_set = True
            logger.info("CPU worker pinned to CPUs %s", cpu_ids)
            return
        if _threads_set:
            return
        _threads_set = True
        if envs.OMP_NUM_THREADS is not None:
            return
        torch.set_num_threads(usable_cores())
        logger.info(
            "CPU platform: %d threads, bf16 native: %s",
            torch.get_num_threads(),
            self.supports_bf16(),
        )

    def prepack_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """oneDNN's blocked (AMX/VNNI) layout, so matmuls skip reordering the weight every call.

        bf16 needs native bf16; fp32 is packed too so the fp32 oracle tests cover this path.
        PAGEDLM_DISABLE_PREPACK=1 keeps dense weights.
        """
        if envs.PAGEDLM_DISABLE_PREPACK:
            return None
        native = weight.dtype == torch.float32 or (
            weight.dtype == torch.bfloat16 and self.supports_bf16()
        )
        if native and torch.backends.mkldnn.is_available():
            return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PREPACK_BATCH_HINT)
        return None

    def _small_batch_isa(self, weight: torch.Tensor) -> str | None:
        """The small-batch kernel that would read a copy of this bf16 weight, or None: no such
        kernel runs, or the process would pass `_DENSE_COPY_RAM_FRACTION` of RAM with that
        copy (a model too big to hold twice keeps the prepacked layout alone, and the KV cache
        keeps its room)."""
        if weight.dtype != torch.bfloat16:
            return None
        from pagedlm.kernels.cpu import small_batch_linear_isa

        isa = small_batch_linear_isa()
        if isa is None:
            return None
        held = psutil.Process().memory_info().rss + weight.numel() * weight.element_size()
        if held > psutil.virtual_memory().total * _DENSE_COPY_RAM_FRACTION:
            return None
        return isa

    def small_batch_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The copy of a bf16 weight that the small-batch kernel reads, held next to oneDNN's
        prepacked one: the dense weight itself for AMX and AVX2, the blocked layout for
        AVX-512 BF16 (`block_small_batch_weight`); None where no such kernel runs, there is no
        room (`_small_batch_isa`) or the shape does not fit."""
        from pagedlm.kernels.cpu import block_small_batch_weight

        isa = self._small_batch_isa(weight)
        if isa is None:
            return None
        return weight if isa in _DENSE_WEIGHT_ISAS else block_small_batch_weight(weight)

    def reads_dense_weight(self, weight: torch.Tensor) -> bool:
        """Whether the small-batch kernel reads the dense weight itself (AMX, AVX2) next to the
        prepacked one; AVX-512 BF16 reads its own blocked copy (`small_batch_weight`)."""
        return self._small_batch_isa(weight) in _DENSE_WEIGHT_ISAS

    def kv_cache_budget_bytes(self, utilization: float, model_bytes: int) -> int:
        """`utilization` of total RAM minus this engine's model, within 90% of what is free:
        other engines in the process (vLLM's tests make several) or the interpreter's own
        memory do not count against it."""
        vm = psutil.virtual_memory()
        budget = int(vm.total * utilization) - model_bytes
        return max(0, min(budget, int(vm.available * 0.9)))

    def memory_in_use_bytes(self) -> int:
        return psutil.Process().memory_info().rss

    def total_memory_bytes(self) -> int:
        return psutil.virtual_memory().total
