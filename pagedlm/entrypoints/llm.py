"""LLM: vLLM's offline facade. Renders prompts, adds requests, runs the engine, orders outputs.

Request ids are "0", "1", ... from a counter that keeps increasing across calls; outputs come
back in input order. If adding any request of a call fails, the ones already added are aborted
and the error is raised, so a failed call leaves nothing behind; likewise an exception while
the engine runs (Ctrl-C included) aborts every queued request before it propagates. A request
that fails inside a step comes back finished with finish_reason "error" (the others go on).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.entrypoints.beam_search import BeamSearchMixin
from pagedlm.entrypoints.chat_utils import render_conversations
from pagedlm.entrypoints.pooling import PoolingMixin
from pagedlm.entrypoints.sleep_and_profiling import SleepAndProfilingMixin
from pagedlm.entrypoints.weight_transfer import WeightTransferMixin
from pagedlm.inputs import per_prompt, prompt_to_seq
from pagedlm.outputs import PoolingRequestOutput, RequestOutput
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def _with_mm_processor_kwargs(prompts: Any, mm_processor_kwargs: dict[str, Any] | None) -> Any:
    """The prompts with the call's `mm_processor_kwargs` under each prompt's own."""
    if not mm_processor_kwargs:
        return prompts
    out = []
    for prompt in prompt_to_seq(prompts):
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        elif not isinstance(prompt, dict):
            prompt = {"prompt_token_ids": prompt}
        own = prompt.get("mm_processor_kwargs") or {}
        out.append({**prompt, "mm_processor_kwargs": {**mm_processor_kwargs, **own}})
    return out


class LLM(BeamSearchMixin, PoolingMixin, WeightTransferMixin, SleepAndProfilingMixin):
    """An offline engine: `LLM(model, **engine_args)`; every option is keyword-only."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        seed: int | None = 0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("disable_log_stats", True)
        dp_size = kwargs.get("data_parallel_size", 1)
        if dp_size > 1 and kwargs.get("distributed_executor_backend") != "external_launcher":
            raise ValueError(
                f"LLM(data_parallel_size={dp_size}) is not supported for single-process usage "
                "and may hang. Please use the explicit multi-process data-parallel example at "
                "'examples/data_parallel.py'."
            )
        if "swap_space" in kwargs:
            kwargs.pop("swap_space")
            logger.warning("swap_space is deprecated and ignored.")
        engine_args = EngineArgs(model=model, tokenizer=tokenizer, seed=seed, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self.engine_class = LLMEngine
        self.model_config = self.llm_engine.model_config
        self.request_counter = itertools.count()
        self.chat_template = chat_template
        self.default_sampling_params: dict[str, Any] | None = None
        self.supported_tasks = self.llm_engine.get_supported_tasks()
        self.runner_type = self.model_config.runner_type

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls(**vars(engine_args))

    # ------------------------------------------------------------ introspection
    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config defaults (cached), or plain SamplingParams()."""
        if self.default_sampling_params is None:
            self.default_sampling_params = self.model_config.get_diff_sampling_param()
        if self.default_sampling_params:
            return SamplingParams.from_optional(**self.default_sampling_params)
        return SamplingParams()

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def reset_mm_cache(self) -> None:
        """Clear the processed-image cache and the encoder outputs no request is using."""
        self.llm_engine.reset_mm_cache()

    def get_metrics(self) -> list[Any]:
        """A snapshot of the vLLM-named Prometheus metrics (needs disable_log_stats=False)."""
        return self.llm_engine.get_metrics()

    def __repr__(self) -> str:
        return f"LLM(model={self.model_config.model!r})"

    # ----------------------------------------------------------------- workers
    def get_world_size(self, include_dp: bool = True) -> int:
        """Ranks of this engine (tensor parallel), times the data-parallel size if asked."""
        parallel = self.llm_engine.vllm_config.parallel_config
        return parallel.world_size * (parallel.data_parallel_size if include_dp else 1)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a Worker method (by name) or `method(worker, *args, **kwargs)` on every rank;
        one result per rank, in rank order."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """`[func(model) for each rank's model]`."""
        return self.llm_engine.apply_model(func)

    # --------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        self._check_generate("LLM.generate()")
        self.llm_engine.check_can_generate()
        prompts = _with_mm_processor_kwargs(prompts, mm_processor_kwargs)
        self._add_requests(
            prompts, sampling_params, use_tqdm, lora_request, priority, tokenization_kwargs
        )
        return self._run_engine(use_tqdm=use_tqdm)

    def enqueue(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: Any = None,
        priority: list[int] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """Add requests without running them; `wait_for_completion()` runs everything queued."""
        if self.runner_type != "generate":
            raise ValueError("LLM.enqueue() is only supported for generative models.")
        prompts = _with_mm_processor_kwargs(prompts, mm_processor_kwargs)
        return self._add_requests(
            prompts, sampling_params, use_tqdm, lora_request, priority, tokenization_kwargs
        )

    def wait_for_completion(
        self, output_type: type | tuple[type, ...] | None = None, *, use_tqdm: bool = True
    ) -> list[Any]:
        return self._run_engine(use_tqdm=use_tqdm, output_type=output_type)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        self._check_generate("LLM.chat()")
        prompts = self._render_chat(
            messages,
            chat_template,
            chat_template_content_format,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
        )
        return self.generate(
            prompts,
            sampling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs,
            mm_processor_kwargs=mm_processor_kwargs,
        )

    def enqueue_chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """`enqueue` for conversations: rendered now, run by `wait_for_completion()`."""
        if self.runner_type != "generate":
            raise ValueError("LLM.enqueue_chat() is only supported for generative models.")
        prompts = self._render_chat(
            messages,
            chat_template,
            chat_template_content_format,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
        )
        prompts = _with_mm_processor_kwargs(prompts, mm_processor_kwargs)
        return self._add_requests(
            prompts, sampling_params, use_tqdm, lora_request, priority, tokenization_kwargs
        )

    def _render_chat(
        self,
        messages: Any,
        chat_template: str | None,
        content_format: str,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[Any]:
        """Conversations -> token prompts, with the call's template, else LLM(chat_template=),
        else the tokenizer's."""
        return render_conversations(
            self.get_tokenizer(),
            messages,
            chat_template=chat_template or self.chat_template,
            chat_template_content_format=content_format,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            image_placeholder=self.llm_engine.image_placeholder,
            allowed_local_media_path=self.model_config.allowed_local_media_path,
        )

    def _check_generate(self, method: str) -> None:
        if self.runner_type != "generate":
            raise ValueError(
                f"{method} is only supported for generative models. Try passing "
                "`--runner generate` to use the model as a generative model."
            )

    # ----------------------------------------------------------------- helpers
    def _add_requests(
        self,
        prompts: Any,
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | Callable[..., tqdm],
        lora_request: Any,
        priority: list[int] | None,
        tokenization_kwargs: dict[str, Any] | None,
    ) -> list[str]:
        prompt_list = prompt_to_seq(prompts)
        n = len(prompt_list)
        if params is None:
            params = self.get_default_sampling_params()
        param_list = per_prompt(params, (SamplingParams, PoolingParams), n, "params")
        if priority is not None:
            if not isinstance(priority, Sequence) or isinstance(priority, str):
                raise TypeError(f"priority must be a list of ints, got {type(priority).__name__}.")
            if len(priority) != n:
                raise ValueError(
                    f"The lengths of prompts ({n}) and priority ({len(priority)}) must be the same."
                )
        if isinstance(lora_request, Sequence):
            if len(lora_request) != n:
                raise ValueError(
                    f"The lengths of prompts ({n}) and lora_request ({len(lora_request)}) "
                    "must be the same."
                )
            lora_list = list(lora_request)
        else:
            lora_list = [lora_request] * n
        # Every adapter is loaded and validated before any request is queued: a bad adapter
        # raises (naming itself) with nothing of this call left in the engine.
        for lora in {id(x): x for x in lora_list if x is not None}.values():
            self.llm_engine.lora_adapters.check_lora_request(lora)
        for p in param_list:
            p.output_kind = RequestOutputKind.FINAL_ONLY
        added: list[str] = []
        items = zip(prompt_list, param_list, strict=True)
        if use_tqdm and n:
            tqdm_func = use_tqdm if callable(use_tqdm) else tqdm
            items = tqdm_func(items, total=n, desc="Rendering prompts", dynamic_ncols=True)
        try:
            for i, (prompt, p) in enumerate(items):
                request_id = str(next(self.request_counter))
                added.append(
                    self.llm_engine.add_request(
                        request_id,
                        prompt,
                        p,
                        lora_request=lora_list[i],
                        tokenization_kwargs=tokenization_kwargs,
                        priority=priority[i] if priority else 0,
                    )
                )
        except BaseException:
            self.llm_engine.abort_request(added, internal=True)
            raise
        return added

    def _run_engine(
        self, *, use_tqdm: bool | Callable[..., tqdm] = True, output_type: Any = None
    ) -> list[Any]:
        engine = self.llm_engine
        output_type = output_type or (RequestOutput, PoolingRequestOutput)
        stashed = (
            engine.sleep_manager.take_stashed_outputs()
        )  # finished while sleep(mode="wait") drained
        if engine.has_unfinished_requests():
            engine.sleep_manager.check_awake()
        pbar = None
        if use_tqdm:
            tqdm_func = use_tqdm if callable(use_tqdm) else tqdm
            pbar = tqdm_func(
                total=engine.get_num_unfinished_requests(),
                desc="Processed prompts",
                dynamic_ncols=True,
                postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s",
            )
        outputs: list[Any] = list(stashed)
        total_in = total_out = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    assert isinstance(output, output_type), type(output)
                    if not output.finished:
                        continue
                    outputs.append(output)
                    if pbar is None:
                        continue
                    if isinstance(output, PoolingRequestOutput):
                        pbar.update(1)
                        continue
                    n = len(output.outputs)
                    total_in += len(output.prompt_token_ids or ()) * n
                    total_out += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = pbar.format_dict["elapsed"] or 1e-9
                    pbar.postfix = (
                        f"est. speed input: {total_in / elapsed:.2f} toks/s, "
                        f"output: {total_out / elapsed:.2f} toks/s"
                    )
                    pbar.update(n)
        except BaseException:
            # Ctrl-C or an error: nothing of this run stays queued, so the next call works
            # and returns only its own outputs
            engine.abort_all_requests()
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return sorted(outputs, key=lambda o: int(o.request_id))
