"""LLMEngine: add_request / step / abort (scheduler, executor, output processing).

One `step()`: schedule -> the executor runs the step on every worker -> update requests ->
build RequestOutputs. Only plain data (SchedulerOutput, ModelRunnerOutput) crosses to the
workers; control calls (`collective_rpc`, `apply_model`) go through the executor to every rank.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import secrets
from collections.abc import Callable
from typing import Any

from pagedlm.config import VllmConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.sched_output import EngineCoreOutput, SchedulerOutput
from pagedlm.core.scheduler import Scheduler
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.input_processor import EngineCoreRequest, InputProcessor
from pagedlm.engine.kv_cache_sizing import determine_num_blocks
from pagedlm.engine.lora_adapters import LoRAAdapters
from pagedlm.engine.output_processor import OutputProcessor, ParentRequest
from pagedlm.engine.sleep import SleepManager
from pagedlm.engine.tokenizer import load_tokenizer
from pagedlm.engine.weight_sync import WeightSync
from pagedlm.executor import Executor
from pagedlm.gc_utils import freeze_gc_heap
from pagedlm.metrics import (
    IterationStats,
    Metric,
    PrometheusStatLogger,
    SchedulerStats,
    get_metrics_snapshot,
)
from pagedlm.outputs import RequestOutput
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import SamplingParams
from pagedlm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, log_stats: bool = True) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.log_stats = log_stats
        self.tokenizer = load_tokenizer(self.model_config)
        self.model_executor = Executor.get_class(vllm_config)(vllm_config)
        num_blocks = determine_num_blocks(vllm_config, self.model_executor)
        self.cache_config.num_gpu_blocks = num_blocks
        block_size = self.cache_config.block_size
        self.model_executor.initialize_kv_cache(num_blocks, block_size)
        kv_cache_manager = KVCacheManager(
            num_blocks, block_size, self.cache_config.enable_prefix_caching
        )
        lora = vllm_config.lora_config
        self.scheduler = Scheduler(
            vllm_config.scheduler_config,
            self.cache_config,
            kv_cache_manager,
            max_loras=lora.max_loras if lora is not None else None,
        )
        self.input_processor = InputProcessor(
            self.model_config, self.tokenizer, vllm_config.speculative_config is not None
        )
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer,
            self.model_config.vocab_size,
            self.input_processor.stop_token_ids(),
            vllm_config.structured_outputs_config,
        )
        self.input_processor.structured_output_manager = self.structured_output_manager
        self.output_processor = OutputProcessor(self.tokenizer, log_stats)
        self.stat_logger = PrometheusStatLogger(self.model_config.model) if log_stats else None
        # More loggers with `record(SchedulerStats, IterationStats)` (AsyncLLM's stat_loggers).
        self.extra_stat_loggers: list[Any] = []
        self._num_preemptions_logged = 0
        self._step_in_flight: SchedulerOutput | None = None  # set while a step runs
        self.last_step_error: str | None = None  # the cause of the last failed step
        # the parts it owns, each named after what it controls
        self.weight_sync = WeightSync(self.model_executor, kv_cache_manager)
        self.sleep_manager = SleepManager(
            self.model_executor,
            self.scheduler,
            self.weight_sync,
            enable_sleep_mode=vllm_config.enable_sleep_mode,
            stat_logger=self.stat_logger,
        )
        self.lora_config = lora
        self.lora_adapters = LoRAAdapters(lora, self.model_executor, self.scheduler)
        freeze_gc_heap()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: Any = None, **_: Any
    ) -> LLMEngine:
        config = engine_args.create_engine_config()
        return cls(config, log_stats=not engine_args.disable_log_stats)

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    # ---------------------------------------------------------------- requests
    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        prompt_text: str | None = None,
    ) -> str:
        """Validate and queue one request; returns its internal id (external + random suffix)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}.")
        if priority != 0 and self.vllm_config.scheduler_config.scheduling_policy != "priority":
            raise ValueError(
                f"Got priority {priority} but Priority scheduling is not enabled. Pass "
                "scheduling_policy='priority' to the engine."
            )
        lora_request = self.lora_adapters.check_lora_request(lora_request)
        if request_id in self.output_processor.external_to_internal:
            raise ValueError(f"Request id {request_id} is already in use by a running request.")
        internal_id = f"{request_id}-{secrets.token_hex(4)}"
        if isinstance(params, PoolingParams):
            if self.model_config.runner_type != "pooling":
                raise ValueError(
                    "PoolingParams need a pooling model; pass runner='pooling' (or "
                    "convert='embed') to use this model for pooling."
                )
            request = self.input_processor.process_pooling_inputs(
                internal_id, prompt, params, arrival_time, priority, tokenization_kwargs
            )
            self._add_core_request(request, request_id, None, 0)
            return internal_id
        if self.model_config.runner_type != "generate":
            raise ValueError("This model does not support generation")
        request = self.input_processor.process_inputs(
            internal_id, prompt, params, arrival_time, priority, tokenization_kwargs
        )
        request.lora_request = lora_request
        self._check_images_fit(request)
        if prompt_text is not None:
            request.prompt = prompt_text
        params = request.sampling_params
        assert params is not None
        if params.n == 1:
            self._add_core_request(request, request_id, None, 0)
            return internal_id
        parent = ParentRequest(request_id, params.n)
        for index in range(params.n):
            child_params = params.clone()
            if params.seed is not None:
                child_params.seed = params.seed + index
            child_params.n = 1
            child = dataclasses.replace(
                request, request_id=f"{index}_{internal_id}", sampling_params=child_params
            )
            self._add_core_request(child, request_id, parent, index)
        return internal_id

    def _check_images_fit(self, request: EngineCoreRequest) -> None:
        """With `disable_chunked_mm_input` an image is scheduled in one step: it must fit the
        token budget."""
        config = self.vllm_config.scheduler_config
        if not (config.disable_chunked_mm_input and request.mm_features):
            return
        biggest = max(f.num_embeds for f in request.mm_features)
        if biggest > config.max_num_batched_tokens:
            raise ValueError(
                f"An image of this prompt takes {biggest} tokens, more than "
                f"max_num_batched_tokens={config.max_num_batched_tokens}, and images are "
                "scheduled whole (disable_chunked_mm_input); raise max_num_batched_tokens or "
                "pass smaller images (mm_processor_kwargs)."
            )

    def _add_core_request(
        self,
        request: EngineCoreRequest,
        external_id: str,
        parent: ParentRequest | None,
        index: int,
    ) -> None:
        """Build the core Request first: if that fails, nothing has been registered."""
        params = request.sampling_params
        core_request = Request(
            request.request_id,
            request.prompt_token_ids,
            params,
            max_tokens=params.max_tokens if params is not None else 0,
            eos_token_id=params.eos_token_id if params is not None else None,
            arrival_time=request.arrival_time,
            priority=request.priority,
            block_size=self.cache_config.block_size,
            cache_salt=request.cache_salt,
            pooling_params=request.pooling_params,
            token_type_ids=request.token_type_ids,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        )
        if params is not None and params.structured_outputs is not None:
            so_manager = self.structured_output_manager
            core_request.structured_output_request = so_manager.init_request(
                params.structured_outputs
            )
        self.output_processor.add_request(request, external_id, parent, index)
        self.scheduler.add_request(core_request)

    def abort_request(self, request_ids: list[str] | str, internal: bool = False) -> None:
        """Abort requests by external id (default; all children too) or by internal id."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        if internal:
            wanted = set(request_ids)
            internal_ids = [
                rid
                for rid in self.output_processor.request_states
                if rid in wanted or rid.partition("_")[2] in wanted
            ]
        else:
            internal_ids = [
                i
                for e in request_ids
                for i in self.output_processor.external_to_internal.get(e, [])
            ]
        self.output_processor.abort_requests(internal_ids)
        self.scheduler.finish_requests(internal_ids, RequestStatus.FINISHED_ABORTED)

    def abort_all_requests(self) -> None:
        """Abort every unfinished request (none gets an output)."""
        ids = list(self.output_processor.request_states)
        self.output_processor.abort_requests(ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        self.sleep_manager.check_awake()
        if self._step_in_flight is not None:  # interrupted (Ctrl-C) inside the last step
            self._recover_from_failed_step([])
        if not self.scheduler.has_unfinished_requests():
            return []
        self.weight_sync.before_step()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled_req_ids:
            raise RuntimeError(
                "The scheduler could not schedule any request although some are waiting; this "
                "is a bug in pagedlm (please report it with the engine arguments used)."
            )
        scheduler_output.grammar_output = self.structured_output_manager.grammar_bitmask(
            self.scheduler.requests[rid] for rid in scheduler_output.scheduled_req_ids
        )
        self._step_in_flight = scheduler_output
        try:
            runner_output = self.model_executor.execute_model(scheduler_output)
        except Exception as error:
            return self._fail_step(scheduler_output, error)
        self._step_in_flight = None
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        iteration_stats = IterationStats() if self.stat_logger is not None else None
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(
            core_outputs, iteration_stats
        )
        if reqs_to_abort:
            self.scheduler.finish_requests(reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        if self.stat_logger is not None and iteration_stats is not None:
            sched_stats = self._scheduler_stats()
            self.stat_logger.record(sched_stats, iteration_stats)
            for extra in self.extra_stat_loggers:
                extra.record(sched_stats, iteration_stats)
            if self.lora_config is not None:
                running, waiting = self.lora_adapters.lora_stats()
                self.stat_logger.record_lora_info(running, waiting, self.lora_config.max_loras)
        return request_outputs

    def _fail_step(self, scheduler_output: SchedulerOutput, error: Exception) -> list[Any]:
        """A step raised: the requests that caused it (all of the step's when the workers could
        not tell) finish with finish_reason "error"; the engine goes on with the others."""
        blamed = getattr(error, "failed_request_ids", None) or scheduler_output.scheduled_req_ids
        failed = [rid for rid in blamed if rid in self.scheduler.requests]
        self.last_step_error = f"{type(error).__name__}: {error}"
        if self.model_executor.is_failed:  # the workers are gone: nothing to recover
            raise error
        states = self.output_processor.request_states
        external = [states[rid].external_req_id if rid in states else rid for rid in failed]
        logger.error(
            "Request(s) %s failed in a model step and finish with finish_reason='error'; the "
            "engine goes on with the others. Cause: %s: %s",
            ", ".join(external),
            type(error).__name__,
            error,
            exc_info=error,
        )
        self._recover_from_failed_step(failed)
        outputs, _ = self.output_processor.process_outputs(
            [EngineCoreOutput(rid, [], finish_reason="error") for rid in failed]
        )
        return outputs

    def _recover_from_failed_step(self, failed_ids: list[str]) -> None:
        """The workers forget their requests (the step may have left them half-applied) and
        the scheduler re-sends every live one whole (`Scheduler.recover_from_failed_step`)."""
        self._step_in_flight = None
        self.scheduler.recover_from_failed_step(failed_ids)
        self.model_executor.collective_rpc("reset_requests")

    def _scheduler_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats.reset()
        preemptions = self.scheduler.num_preemptions - self._num_preemptions_logged
        self._num_preemptions_logged = self.scheduler.num_preemptions
        processor = self.input_processor.mm_processor
        mm_queries, mm_hits = processor.cache.take_stats() if processor is not None else (0, 0)
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=preemptions,
            mm_cache_queries=mm_queries,
            mm_cache_hits=mm_hits,
            spec_decoding=self.scheduler.spec_decoding_stats.reset()
            if self.vllm_config.speculative_config is not None
            else None,
        )

    def get_metrics(self) -> list[Metric]:
        assert self.log_stats, "Stat logging disabled"
        return get_metrics_snapshot()

    def do_log_stats(self) -> None:
        """Metrics are kept continuously; nothing to flush."""

    # ----------------------------------------------------------------- control
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    @property
    def image_placeholder(self) -> str | None:
        """The text a string chat template gets per image (None: the model takes no images)."""
        processor = self.input_processor.mm_processor
        return processor.placeholder_str if processor is not None else None

    def reset_mm_cache(self) -> None:
        """Clear the processed-image cache and evict the encoder outputs no request uses."""
        processor = self.input_processor.mm_processor
        if processor is not None:
            processor.cache.clear()
        self.scheduler.reset_encoder_cache()

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.model_config.supported_tasks

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self.model_executor.collective_rpc(method, timeout, args, kwargs)

    # -------------------------------------- control: the owned parts do the work
    def _settle_requests(self, mode: str) -> list[RequestOutput]:
        """Before sleeping: "abort" every request, or "wait" (step until none is left: the
        outputs of those that finished), or "keep" them (preempted, recomputed after)."""
        finished: list[RequestOutput] = []
        if mode == "abort":
            self.abort_all_requests()
        while mode == "wait" and self.has_unfinished_requests():
            finished += [o for o in self.step() if o.finished]
        return finished

    def check_can_generate(self) -> None:
        """Raise (before any request is added) if a step could not run now."""
        self.sleep_manager.check_awake()
        self.weight_sync.check_weights_present()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.sleep_manager.sleep(level, mode, self._settle_requests)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.sleep_manager.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_manager.is_sleeping()

    def release_kv_cache_memory(self) -> None:
        self.sleep_manager.release_kv_cache_memory()

    def set_weight_version(self, version: str) -> None:
        self.weight_sync.weight_version = version

    def get_weight_version(self) -> str | None:
        return self.weight_sync.weight_version

    def add_lora(self, lora_request: Any) -> bool:
        return self.lora_adapters.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora_adapters.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.lora_adapters.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self.lora_adapters.pin_lora(lora_id)

    def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        args = (profile_prefix, delay_iterations, max_iterations)
        self.model_executor.collective_rpc("start_profile", args=args)

    def stop_profile(self) -> list[str]:
        return self.model_executor.collective_rpc("stop_profile")

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        return self.collective_rpc("apply_model", args=(func,))

    def shutdown(self) -> None:
        self.model_executor.shutdown()
        gc.unfreeze()
