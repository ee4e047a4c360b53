"""Engine core outputs -> RequestOutputs: detokenize, find stop strings, gather logprobs, fan in n.

Invariant: one RequestState per internal request id, removed when it finishes; a parent with
n children emits (FINAL_ONLY) a single RequestOutput once every child finished, outputs ordered
by index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedlm.core.sched_output import EngineCoreOutput
from pagedlm.engine.detokenizer import IncrementalDetokenizer
from pagedlm.engine.detokenizer_utils import (
    REPLACEMENT_CHAR,
    convert_ids_list_to_tokens,
    correct_decoded_tokens,
)
from pagedlm.engine.input_processor import EngineCoreRequest
from pagedlm.logprobs import (
    PromptLogprobs,
    SampleLogprobs,
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
    last_sampled_token_ids,
)
from pagedlm.metrics import FinishedRequestStats, IterationStats
from pagedlm.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    RequestStateStats,
    SamplingMask,
)
from pagedlm.runner_outputs import LogprobsLists
from pagedlm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ParentRequest:
    """Fans in the n children of one user request."""

    external_req_id: str
    n: int
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0

    def add(self, child_index: int, output: CompletionOutput, finished: bool) -> bool:
        self.outputs[child_index] = output
        self.num_finished += finished
        return self.num_finished == self.n

    def ordered(self) -> list[CompletionOutput]:
        return [self.outputs[i] for i in sorted(self.outputs)]


class RequestState:
    def __init__(
        self,
        request: EngineCoreRequest,
        external_req_id: str,
        tokenizer: Any,
        parent: ParentRequest | None,
        child_index: int,
        log_stats: bool,
    ) -> None:
        self.pooling = request.pooling_params is not None
        params = request.sampling_params or SamplingParams(max_tokens=1, detokenize=False)
        self.request_id = request.request_id
        self.external_req_id = external_req_id
        self.parent = parent
        self.child_index = child_index
        self.prompt = request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.lora_request = request.lora_request
        self.params: SamplingParams = params
        self.output_kind = params.output_kind
        self.tokenizer = tokenizer if params.detokenize else None
        self.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        wants_logprobs = params.num_logprobs is not None  # logprobs or logprob_token_ids
        self.logprobs = create_sample_logprobs(params.flat_logprobs) if wants_logprobs else None
        self.prompt_logprobs = (
            create_prompt_logprobs(params.flat_logprobs)
            if params.prompt_logprobs is not None
            else None
        )
        self.cumulative_logprob = 0.0 if wants_logprobs else None
        self.sampling_mask: list[list[int]] = []  # filled when the engine returns masks
        self.num_cached_tokens = 0
        self.sent_text_offset = 0
        self.stats = RequestStateStats(arrival_time=request.arrival_time) if log_stats else None
        if self.stats is not None:
            self.stats.queued_ts = time.monotonic()

    def _decoded(
        self, ids: list[int], target: PromptLogprobs | SampleLogprobs
    ) -> list[str] | list[None]:
        """Each candidate's own string; partial UTF-8 ones are completed from the tokens of
        the positions before (vLLM's U+FFFD correction)."""
        if self.tokenizer is None:
            return [None] * len(ids)
        texts = convert_ids_list_to_tokens(self.tokenizer, ids)
        if any(text.endswith(REPLACEMENT_CHAR) for text in texts):
            context = last_sampled_token_ids(target, 4)
            correct_decoded_tokens(self.tokenizer, texts, ids, context)
        return texts

    def add_logprobs(self, lists: LogprobsLists | None, prompt: bool) -> None:
        target = self.prompt_logprobs if prompt else self.logprobs
        if lists is None or target is None:
            return
        k = self.params.prompt_logprobs if prompt else self.params.num_logprobs
        for ids, values, rank in zip(
            lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True
        ):
            append_logprobs_for_next_position(
                target, ids, values, self._decoded(ids, target), rank, k
            )
            if not prompt and self.cumulative_logprob is not None:
                self.cumulative_logprob += values[0]

    def completion(self, finish_reason: str | None, stop_reason: Any) -> CompletionOutput:
        delta = self.output_kind == RequestOutputKind.DELTA
        finished = finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta)
        token_ids = self.detokenizer.token_ids
        logprobs = self.logprobs
        mask_rows: list[list[int]] | None = self.sampling_mask if self.sampling_mask else None
        if delta:
            token_ids = token_ids[self.sent_text_offset :]
            if logprobs is not None:
                logprobs = logprobs[self.sent_text_offset :]
            if mask_rows is not None:
                mask_rows = mask_rows[self.sent_text_offset :]
            self.sent_text_offset = len(self.detokenizer.token_ids)
        return CompletionOutput(
            index=self.child_index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            sampling_mask=None if mask_rows is None else SamplingMask(list(mask_rows)),
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any, log_stats: bool) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.external_to_internal: dict[str, list[str]] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        external_req_id: str,
        parent: ParentRequest | None = None,
        child_index: int = 0,
    ) -> None:
        self.request_states[request.request_id] = RequestState(
            request, external_req_id, self.tokenizer, parent, child_index, self.log_stats
        )
        self.external_to_internal.setdefault(external_req_id, []).append(request.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, internal_ids: list[str]) -> None:
        for rid in internal_ids:
            state = self.request_states.pop(rid, None)
            if state is not None:
                self._forget(state)

    def _forget(self, state: RequestState) -> None:
        ids = self.external_to_internal.get(state.external_req_id, [])
        if state.request_id in ids:
            ids.remove(state.request_id)
        if not ids:
            self.external_to_internal.pop(state.external_req_id, None)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], iteration_stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out and the ids finished by a stop string."""
        request_outputs: list[RequestOutput | PoolingRequestOutput] = []
        reqs_to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            state.num_cached_tokens = out.num_cached_tokens
            if state.pooling:
                if out.pooling_output is not None or out.finish_reason == "error":
                    # an error (a failed step) comes out as an output without data
                    request_outputs.append(
                        PoolingRequestOutput(
                            state.external_req_id,
                            PoolingOutput(out.pooling_output),
                            state.prompt_token_ids,
                            out.num_cached_tokens,
                            True,
                        )
                    )
                if out.finished:
                    del self.request_states[out.request_id]
                    self._forget(state)
                continue
            state.add_logprobs(out.new_prompt_logprobs, prompt=True)
            state.add_logprobs(out.new_logprobs, prompt=False)
            if out.new_sampling_mask is not None:
                state.sampling_mask.extend(out.new_sampling_mask)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if out.new_token_ids:
                stop_terminated = finish_reason == "stop" and not isinstance(stop_reason, str)
                stop_str = state.detokenizer.update(out.new_token_ids, stop_terminated)
                if stop_str is not None:
                    if finish_reason is None:  # still running in the core: end it there
                        reqs_to_abort.append(out.request_id)
                    finish_reason, stop_reason = "stop", stop_str
                if state.stats is not None:
                    state.stats.scheduled_ts = out.scheduled_ts
                    self._update_stats(state, len(out.new_token_ids), now, iteration_stats)
            request_output = self._make_request_output(state, finish_reason, stop_reason)
            if request_output is not None:
                request_outputs.append(request_output)
            if finish_reason is not None:
                del self.request_states[out.request_id]
                self._forget(state)
                if iteration_stats is not None and state.stats is not None:
                    iteration_stats.finished_requests.append(
                        self._finished_stats(state, finish_reason, now)
                    )
        return request_outputs, reqs_to_abort

    @staticmethod
    def _update_stats(
        state: RequestState, num_new: int, now: float, it: IterationStats | None
    ) -> None:
        stats = state.stats
        assert stats is not None
        if not stats.first_token_ts:
            stats.first_token_ts = now
            stats.first_token_latency = time.time() - stats.arrival_time
            if it is not None:
                it.num_prompt_tokens += len(state.prompt_token_ids)
                it.time_to_first_tokens.append(stats.first_token_latency)
        elif it is not None:
            it.inter_token_latencies.append(now - stats.last_token_ts)
        if it is not None:
            it.num_generation_tokens += num_new
        stats.last_token_ts = now
        stats.num_generation_tokens += num_new

    @staticmethod
    def _finished_stats(state: RequestState, reason: str, now: float) -> FinishedRequestStats:
        s = state.stats
        assert s is not None
        scheduled = s.scheduled_ts or now
        first = s.first_token_ts or now
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=time.time() - s.arrival_time,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=s.num_generation_tokens,
            max_tokens=state.params.max_tokens,
            n=state.parent.n if state.parent is not None else 1,
            queued_time=max(0.0, scheduled - s.queued_ts),
            prefill_time=max(0.0, first - scheduled),
            decode_time=max(0.0, s.last_token_ts - first),
            inference_time=max(0.0, s.last_token_ts - scheduled),
        )

    def _make_request_output(
        self, state: RequestState, finish_reason: str | None, stop_reason: Any
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = state.completion(finish_reason, stop_reason)
        outputs = [completion]
        if state.parent is not None:
            all_done = state.parent.add(state.child_index, completion, finished)
            if state.output_kind == RequestOutputKind.FINAL_ONLY and not all_done:
                return None
            finished = all_done
            outputs = state.parent.ordered()
        return RequestOutput(
            request_id=state.external_req_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=state.stats,
            lora_request=state.lora_request,
            num_cached_tokens=state.num_cached_tokens,
        )
