"""A worker's sleep calls (reached by `collective_rpc` by name): free and restore the KV
cache (level >= 1) and discard the weights (level 2).

Invariant: freed KV cache and weight pages are returned to the OS (`trim_malloc_heap`) before
`sleep` returns; `wake_up_kv_cache` allocates the same blocks again.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from pagedlm.models.weight_reload import check_can_discard, discard_weights
from pagedlm.utils import trim_malloc_heap

if TYPE_CHECKING:
    from pagedlm.models.interfaces import ModelBase
    from pagedlm.worker.model_runner import ModelRunner


def release_memory_to_os() -> None:
    """Return freed heap pages to the OS (the allocator keeps them otherwise), and cached
    CUDA blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim_malloc_heap()


class WorkerSleepMixin:
    model_runner: ModelRunner | None
    _model: ModelBase  # Worker's: the loaded model
    _kv_num_blocks: int

    def kv_cache_nbytes(self) -> int:
        assert self.model_runner is not None, "load_model() first"
        return sum(c.numel() * c.element_size() for c in self.model_runner.kv_caches)

    def check_can_sleep(self, level: int) -> None:
        if level >= 2:
            check_can_discard(self._model)

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level >= 1) and the weights (level 2); returns bytes freed."""
        runner = self.model_runner
        assert runner is not None, "load_model() first"
        freed = self.kv_cache_nbytes()
        if runner.kv_caches:  # [2, num_blocks, block_size, ...]: what wake_up allocates again
            self._kv_num_blocks = runner.kv_caches[0].shape[1]
        runner.free_kv_caches()
        if level >= 2:
            mapping = self._model.stacked_params_mapping
            freed += discard_weights(self._model, mapping)
        release_memory_to_os()
        return freed

    def wake_up_kv_cache(self) -> None:
        """Allocate the KV cache again, as it was: same blocks, same dtype (fp8 stays fp8;
        zeroed, pages mapped when first used)."""
        runner = self.model_runner
        assert runner is not None, "load_model() first"
        if runner.kv_caches:
            return
        runner.allocate_kv_caches(self._kv_num_blocks)
