"""Worker control calls (reached by `collective_rpc` by name): weight transfer and reloads,
sleep / wake-up of the KV cache and weights, and the torch profiler.

Invariants: a weight update is applied all-or-nothing per `update_weights` call and only
between `start_weight_update` and `finish_weight_update`; freed KV cache and weight pages
are returned to the OS (`malloc_trim`) before `sleep` returns.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from typing import Any

import torch

from pagedlm.layers.attention import allocate_kv_caches
from pagedlm.models.weight_reload import check_can_discard, discard_weights, weights_missing
from pagedlm.worker.profiler import WorkerProfiler

logger = logging.getLogger(__name__)


class ProfilerAlreadyActiveError(RuntimeError):
    """start_profile() while a profile is running."""


def release_memory_to_os() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise), and cached CUDA
    blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class WorkerControlMixin:
    """Mixed into Worker; expects `vllm_config`, `rank` and `model_runner`."""

    vllm_config: Any
    rank: int
    model_runner: Any

    # ---------------------------------------------------------------- weights
    @property
    def _model(self) -> torch.nn.Module:
        assert self.model_runner is not None, "load_model() first"
        return self.model_runner.model

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Incremental, non-strict load of checkpoint-named tensors; returns how many params."""
        return len(self._model.load_weights(weights))

    def reload_weights(self) -> None:
        """Load every weight again from the model's checkpoint (e.g. after sleep level 2)."""
        from pagedlm.model_loader.loader import iterate_checkpoint

        self._model.load_weights(iterate_checkpoint(self.vllm_config.model_config))
        release_memory_to_os()  # the checkpoint's staging copies

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from pagedlm.distributed.weight_transfer import WeightTransferEngineFactory

        config = self.vllm_config.weight_transfer_config
        if config is None:
            raise ValueError(
                "Weight transfer is not configured: pass weight_transfer_config="
                "WeightTransferConfig(backend='ipc' or 'gloo') (or a dict) to LLM(...)."
            )
        engine = WeightTransferEngineFactory.create_engine(config, self.vllm_config, self.rank)
        engine.init_transfer_engine(engine.parse_init_info(dict(init_info or {})))
        self._shutdown_transfer_engine()
        self.weight_transfer_engine = engine
        self._weight_update_active = False

    def _transfer_engine(self) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError(
                "No weight transfer engine: call init_weight_transfer_engine() first."
            )
        return engine

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self._transfer_engine()
        if not is_checkpoint_format:
            raise NotImplementedError(
                "start_weight_update(is_checkpoint_format=False) (weights in the engine's "
                "fused layout) is not supported; send Hugging Face checkpoint names."
            )
        if self._weight_update_active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active; call "
                "finish_weight_update first."
            )
        self._weight_update_active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        engine = self._transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError(
                "update_weights called outside a weight update: call start_weight_update() "
                "first and finish_weight_update() after the last chunk."
            )
        info = engine.parse_update_info(dict(update_info))
        engine.receive_weights(info, self._model.load_weights)

    def finish_weight_update(self) -> None:
        self._transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError(
                "finish_weight_update called without a matching start_weight_update."
            )
        self._weight_update_active = False

    def _shutdown_transfer_engine(self) -> None:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.shutdown()
        self.weight_transfer_engine = None
        self._weight_update_active = False

    def shutdown_weight_transfer_engine(self) -> None:
        self._shutdown_transfer_engine()

    # ------------------------------------------------------------------ sleep
    def check_weights_present(self) -> None:
        missing = weights_missing(self._model)
        if missing:
            raise RuntimeError(
                f"The weights were discarded by sleep(level=2) and {len(missing)} are not "
                f"loaded yet (e.g. {missing[0]}): push them (update_weights / load_weights) "
                "or call llm.collective_rpc('reload_weights') before generating."
            )

    def kv_cache_nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.model_runner.kv_caches)

    def check_can_sleep(self, level: int) -> None:
        if level >= 2:
            check_can_discard(self._model)

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level >= 1) and the weights (level 2); returns bytes freed."""
        runner = self.model_runner
        freed = self.kv_cache_nbytes()
        if runner.kv_caches:  # [2, num_blocks, block_size, ...]: what wake_up allocates again
            self._kv_blocks = tuple(runner.kv_caches[0].shape[1:3])
        for layer in runner.attn_layers:
            layer.kv_cache = None
        runner.kv_caches = []
        if level >= 2:
            mapping = self._model.stacked_params_mapping
            freed += discard_weights(self._model, mapping)
        release_memory_to_os()
        return freed

    def wake_up_kv_cache(self) -> None:
        """Allocate the KV cache again, as it was: same blocks, same dtype (fp8 stays fp8;
        zeroed, pages mapped when first used)."""
        runner = self.model_runner
        if runner.kv_caches:
            return
        num_blocks, block_size = self._kv_blocks
        runner.kv_caches = allocate_kv_caches(
            runner.attn_layers, num_blocks, block_size, runner.kv_cache_dtype()
        )

    # -------------------------------------------------------------- profiler
    def start_profile(
        self,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        config = self.vllm_config.profiler_config
        if config.profiler != "torch":
            raise RuntimeError(
                "Profiling is not enabled: pass profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': '/path'} to LLM(...) or set VLLM_TORCH_PROFILER_DIR."
            )
        profiler = self.profiler
        if profiler is None:
            profiler = self.profiler = WorkerProfiler(config, self.rank)
        if profiler.active:
            raise ProfilerAlreadyActiveError(
                "A profile is already running: call stop_profile() first."
            )
        profiler.start(profile_prefix, delay_iterations, max_iterations)

    def stop_profile(self) -> str | None:
        """Stop and write this rank's Chrome trace; its path (None if nothing was recorded)."""
        # as vLLM, stopping a stopped (or never started) profiler does nothing
        return None if self.profiler is None else self.profiler.stop()
