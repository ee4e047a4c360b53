"""The in-process executor: one worker, rank 0, in the engine's own process and thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pagedlm.config import VllmConfig
from pagedlm.executor.abstract import Executor, note_rank, run_method
from pagedlm.worker.worker import Worker


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.driver_worker = Worker(vllm_config, rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def take_weights_changed(self) -> bool:
        return self.driver_worker.take_weights_changed()

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives and dies with this process."""

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        kwargs = kwargs or {}
        if timeout is None:
            try:
                return [run_method(self.driver_worker, method, args, kwargs)]
            except Exception as e:
                raise note_rank(e, 0, method) from None
        return [self._run_with_timeout(method, timeout, args, kwargs)]

    def _run_with_timeout(
        self, method: str | Callable[..., Any], timeout: float, args: tuple, kwargs: dict
    ) -> Any:
        """Run in a helper thread and stop waiting after `timeout` s (the call itself cannot be
        interrupted in-process: it finishes in the background)."""
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                result["value"] = run_method(self.driver_worker, method, args, kwargs)
            except BaseException as e:  # re-raised in the caller
                result["error"] = e

        thread = threading.Thread(target=target, daemon=True, name="collective_rpc")
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"collective_rpc({method!r}) did not finish within {timeout} s")
        if "error" in result:
            raise note_rank(result["error"], 0, method)
        return result["value"]
