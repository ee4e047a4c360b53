"""The executor interface: every call reaches every rank; the engine sees one answer per rank.

`collective_rpc(method, ...)` runs a Worker method by name, or a callable taking the worker
as its first argument, on every rank and returns the results in rank order. An exception on
any rank is raised in the caller, noted with the rank; `timeout` (seconds) raises
TimeoutError. `execute_model` returns the first rank's output (all ranks compute the step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagedlm.config import VllmConfig
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.runner_outputs import ModelRunnerOutput


class Executor(ABC):
    in_process = False  # the workers live in this process (their state is cheap to read)

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.is_failed = False
        self._weights_changed = False

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from pagedlm.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from pagedlm.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        raise ValueError(f"Unknown distributed_executor_backend {backend!r} (uni or mp).")

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run `method` on every rank; one result per rank, in rank order."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", args=(scheduler_output,))[0]

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.collective_rpc("initialize_kv_cache", args=(num_blocks, block_size))

    def take_weights_changed(self) -> bool:
        """Whether a worker committed new weights (by any path: weight transfer, `load_weights`
        on the model, `collective_rpc`) since the last call. Worker processes say so with
        their replies; the in-process executor asks its worker."""
        changed, self._weights_changed = self._weights_changed, False
        return changed

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=10)

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


def run_method(obj: Any, method: str | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`obj.method(*args, **kwargs)` for a name, `method(obj, *args, **kwargs)` for a callable."""
    if isinstance(method, str):
        return getattr(obj, method)(*args, **kwargs)
    return method(obj, *args, **kwargs)


def note_rank(error: BaseException, rank: int, method: str | Callable[..., Any]) -> BaseException:
    name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
    if hasattr(error, "add_note"):
        error.add_note(f"(raised by {name!r} on worker rank {rank})")
    return error
