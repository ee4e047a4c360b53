"""AsyncLLM (vLLM's AsyncLLMEngine): many coroutines submit requests to one engine.

One engine loop (an asyncio task, started with the first request) steps the engine while
requests are pending; each `engine.step()` runs in a single worker thread so the event loop
stays responsive. Every request added before a step joins that step's batch, so concurrent
`generate` calls are batched together (continuous batching across coroutines).

Invariants:
- The engine is touched only while `_engine_lock` (an asyncio.Lock, FIFO) is held: by the loop
  around a step, by `_add` around `add_request`, by `abort` around `abort_request`.
- Each live request id has one output queue; it gets RequestOutputs (or PoolingRequestOutputs)
  until one is `finished`, or an exception if the engine died.
- A request that fails validation raises in its own coroutine and leaves nothing queued; an
  exception in `engine.step()` kills the engine (EngineDeadError to every waiting request).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedlm.config import VllmConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.exceptions import EngineDeadError
from pagedlm.outputs import PoolingRequestOutput, RequestOutput
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Asynchronous front end of LLMEngine with vLLM's AsyncLLM / AsyncLLMEngine methods."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        log_stats: bool = True,
        stat_loggers: list[Any] | None = None,
        log_requests: bool = False,
        **_: Any,
    ) -> None:
        self.engine = LLMEngine(vllm_config, log_stats=log_stats or bool(stat_loggers))
        # vLLM's interface: each entry is a factory `(vllm_config, engine_index) -> logger`.
        self.stat_loggers = [factory(vllm_config, 0) for factory in stat_loggers or ()]
        self.engine.extra_stat_loggers.extend(self.stat_loggers)
        self.vllm_config = vllm_config
        self.model_config = self.engine.model_config
        self.log_stats = log_stats
        self.log_requests = log_requests  # vLLM's enable_log_requests: each add and abort
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedlm-step")
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._engine_lock: asyncio.Lock | None = None
        self._bound_loop: asyncio.AbstractEventLoop | None = None
        self._has_work: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._pending_aborts: set[str] = set()
        self._dead_error: BaseException | None = None
        self._shut_down = False

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: list[Any] | None = None,
        **kwargs: Any,
    ) -> AsyncLLM:
        config = engine_args.create_engine_config()
        return cls(
            config,
            log_stats=not engine_args.disable_log_stats,
            stat_loggers=stat_loggers,
            log_requests=getattr(engine_args, "enable_log_requests", False),
        )

    @classmethod
    def from_vllm_config(
        cls, vllm_config: VllmConfig, stat_loggers: list[Any] | None = None, **kwargs: Any
    ) -> AsyncLLM:
        return cls(
            vllm_config, log_stats=not vllm_config.disable_log_stats, stat_loggers=stat_loggers
        )

    # ----------------------------------------------------------------- state
    @property
    def is_running(self) -> bool:
        return not self._shut_down and self._dead_error is None

    @property
    def is_stopped(self) -> bool:
        return self._shut_down

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(f"The engine loop died: {self._dead_error!r}")

    async def get_tokenizer(self, lora_request: Any = None) -> Any:
        return self.engine.get_tokenizer()

    async def get_model_config(self) -> Any:
        return self.model_config

    async def get_vllm_config(self) -> VllmConfig:
        return self.vllm_config

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self.engine.get_supported_tasks()

    async def is_tracing_enabled(self) -> bool:
        return False

    async def check_health(self) -> None:
        if self._dead_error is not None:
            raise self.dead_error

    async def do_log_stats(self, *args: Any, **kwargs: Any) -> None:
        self.engine.do_log_stats()
        for stat_logger in self.stat_loggers:
            stat_logger.log()

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        async with self._lock():
            return self.engine.reset_prefix_cache()

    async def reset_mm_cache(self) -> None:
        async with self._lock():
            self.engine.reset_mm_cache()

    # ----------------------------------------------------------------- sleep
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """`LLMEngine.sleep`; requests that finish while mode="wait" drains reach their
        streams, and aborted ones end theirs."""
        async with self._lock():
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self.engine.sleep, level, mode)
            self._dispatch(self.engine.sleep_manager.take_stashed_outputs())
            live = self.engine.output_processor.external_to_internal
            for rid in [r for r in self._queues if r not in live]:  # aborted by the sleep
                self._end_aborted(rid)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        async with self._lock():
            self.engine.wake_up(tags)
        if self._has_work is not None:
            self._has_work.set()  # the loop sleeps while the engine does

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    # ------------------------------------------------------------------ LoRA
    async def add_lora(self, lora_request: Any) -> bool:
        async with self._lock():
            return self.engine.add_lora(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        async with self._lock():
            return self.engine.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        async with self._lock():
            return self.engine.list_loras()

    async def pin_lora(self, lora_id: int) -> bool:
        async with self._lock():
            return self.engine.pin_lora(lora_id)

    # -------------------------------------------------------------- requests
    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield RequestOutputs of one request as its `output_kind` says, until finished."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"generate() takes SamplingParams, got {type(sampling_params).__name__}; use "
                "encode() with PoolingParams for pooling models."
            )
        queue = await self._add(
            request_id,
            prompt,
            sampling_params,
            lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs,
            priority=priority,
            prompt_text=prompt_text,
        )
        async for out in self._drain(request_id, queue):
            yield out

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Any = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        **_: Any,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Yield the one PoolingRequestOutput of a pooling request."""
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"encode() takes PoolingParams, got {type(pooling_params).__name__}.")
        if truncate_prompt_tokens is not None:
            tokenization_kwargs = {
                **(tokenization_kwargs or {}),
                "truncation": True,
                "max_length": truncate_prompt_tokens,
            }
        queue = await self._add(
            request_id,
            prompt,
            pooling_params,
            lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs,
            priority=priority,
        )
        async for out in self._drain(request_id, queue):
            yield out

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        async with self._lock():
            self.engine.abort_request(ids, internal=internal)
        if self.log_requests:
            logger.info("Aborted request(s) %s", ", ".join(ids))
        for rid in ids:
            self._end_aborted(rid)

    def shutdown(self) -> None:
        """Stop the loop, fail waiting requests, release the worker thread. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError("The engine was shut down."))
        self._queues.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)

    # -------------------------------------------------------------- internals
    def _end_aborted(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} was aborted"))

    def _dispatch(self, outputs: list[Any]) -> None:
        """Each output to its request's stream; a finished request's stream is done."""
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            queue.put_nowait(out)
            if out.finished:
                del self._queues[out.request_id]

    def _lock(self) -> asyncio.Lock:
        """The engine lock of the running event loop (a new loop, e.g. asyncio.run, gets one)."""
        loop = asyncio.get_running_loop()
        if self._engine_lock is None or self._bound_loop is not loop:
            self._engine_lock = asyncio.Lock()
            self._bound_loop = loop
        return self._engine_lock

    async def _add(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        *,
        lora_request: Any,
        tokenization_kwargs: dict[str, Any] | None,
        priority: int,
        prompt_text: str | None = None,
    ) -> asyncio.Queue[Any]:
        if self._shut_down:
            raise EngineDeadError("The engine was shut down.")
        if self._dead_error is not None:
            raise self.dead_error
        if request_id in self._queues:
            raise ValueError(f"Request id {request_id} is already in use by a running request.")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        async with self._lock():
            self.engine.add_request(
                request_id,
                prompt,
                params,
                lora_request=lora_request,
                tokenization_kwargs=tokenization_kwargs,
                priority=priority,
                prompt_text=prompt_text,
            )
            self._queues[request_id] = queue
        if self.log_requests:
            logger.info("Added request %s, params: %s", request_id, params)
        self._start_loop()
        assert self._has_work is not None
        self._has_work.set()
        return queue

    async def _drain(self, request_id: str, queue: asyncio.Queue[Any]) -> AsyncGenerator[Any, None]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer stopped early or was cancelled: free the request
                self._pending_aborts.add(request_id)
                self._queues.pop(request_id, None)
                if self._has_work is not None:
                    self._has_work.set()

    def _start_loop(self) -> None:
        if self._loop_task is not None and not self._loop_task.done():
            return
        self._has_work = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run_engine_loop())

    async def _run_engine_loop(self) -> None:
        assert self._has_work is not None
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while not self._shut_down:
                async with self._lock():
                    if self._pending_aborts:
                        engine.abort_request(list(self._pending_aborts))
                        self._pending_aborts.clear()
                    has_work = engine.has_unfinished_requests() and not engine.is_sleeping()
                    if has_work:
                        outputs = await loop.run_in_executor(self._executor, engine.step)
                if not has_work:
                    self._has_work.clear()
                    await self._has_work.wait()
                    continue
                self._dispatch(outputs)
                await asyncio.sleep(0)  # let submitters and consumers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.exception("The pagedlm engine loop died")
            self._dead_error = e
            error = EngineDeadError(f"The engine loop died: {e!r}")
            error.__cause__ = e
            for queue in self._queues.values():
                queue.put_nowait(error)
            self._queues.clear()


AsyncLLMEngine = AsyncLLM
