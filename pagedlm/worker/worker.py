"""Worker: one rank. Sets up its device and threads, joins the process group, holds the model
runner, and answers the executor's calls (`collective_rpc` reaches any method here by name).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from pagedlm.config import VllmConfig
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.distributed import init_distributed_environment
from pagedlm.gc_utils import freeze_gc_heap
from pagedlm.models.interfaces import ModelBase
from pagedlm.platforms import current_platform
from pagedlm.runner_outputs import ModelRunnerOutput
from pagedlm.worker.lora_model_runner_mixin import WorkerLoRAMixin
from pagedlm.worker.model_runner import ModelRunner
from pagedlm.worker.profiler import WorkerProfiler, WorkerProfilerMixin
from pagedlm.worker.weight_updates import WorkerWeightUpdatesMixin
from pagedlm.worker.worker_sleep import WorkerSleepMixin

logger = logging.getLogger(__name__)


class Worker(WorkerWeightUpdatesMixin, WorkerSleepMixin, WorkerProfilerMixin, WorkerLoRAMixin):
    """The mixins are the calls `collective_rpc` reaches by name, one file per concern."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
        cpu_ids: list[int] | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.cpu_ids = cpu_ids
        self.model_runner: ModelRunner | None = None
        self.model_memory_bytes = 0  # what loading the model added to this process
        self.profiler: WorkerProfiler | None = None  # made by the first start_profile
        self.weight_transfer_engine: Any = None
        self._weight_update_active = False
        self._weights_changed = threading.Event()

    def init_device(self) -> None:
        """Threads (pinned in a worker process), the process group, the seed."""
        current_platform.setup_threads(self.cpu_ids)
        parallel = self.vllm_config.parallel_config
        if parallel.world_size > 1:
            assert self.distributed_init_method is not None
            init_distributed_environment(
                parallel.world_size,
                self.rank,
                self.distributed_init_method,
                current_platform.dist_backend,
            )
        current_platform.seed_everything(self.vllm_config.model_config.seed)

    def load_model(self) -> None:
        before = current_platform.memory_in_use_bytes()
        self.model_runner = ModelRunner(self.vllm_config, current_platform.device)
        # the model says when it commits new weights (no reference back to this worker)
        self.model_runner.model.weights_changed_callback = self._weights_changed.set
        self.model_memory_bytes = max(0, current_platform.memory_in_use_bytes() - before)

    def take_weights_changed(self) -> bool:
        """Whether the model committed new weights since the last call."""
        changed = self._weights_changed.is_set()
        self._weights_changed.clear()
        return changed

    def _runner(self) -> ModelRunner:
        assert self.model_runner is not None, "load_model() first"
        return self.model_runner

    @property
    def _model(self) -> ModelBase:  # type: ignore[override]
        return self._runner().model

    # ------------------------------------------------------------- KV cache
    def get_kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self._runner().get_kv_cache_bytes_per_block(block_size)

    def determine_available_memory(self, utilization: float) -> int:
        """Bytes this rank may give its KV cache; ranks on one host share its memory."""
        world = self.vllm_config.parallel_config.world_size
        return current_platform.kv_cache_budget_bytes(utilization / world, self.model_memory_bytes)

    def total_memory_bytes(self) -> int:
        return current_platform.total_memory_bytes()

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._runner().initialize_kv_cache(num_blocks, block_size)
        freeze_gc_heap()  # the worker's startup is over (a worker process's own heap)

    # ----------------------------------------------------------------- step
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._runner().execute_model(scheduler_output)
        if self.profiler is not None:
            self.profiler.step()  # iteration windows (delay / schedule / max_iterations)
        return output

    def reset_requests(self) -> None:
        """After a failed step: forget the batch (the scheduler re-sends every request)."""
        self._runner().reset_requests()

    # -------------------------------------------------------------- control
    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> Any:
        return func(self._runner().model)

    def check_health(self) -> bool:
        return True
