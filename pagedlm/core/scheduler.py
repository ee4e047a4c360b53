"""vLLM v1's single scheduling loop: no prefill or decode phases, one token budget per step.

Each step, running requests are served first (in order), then waiting ones are admitted while
the budget, `max_num_seqs` and the KV pool allow. A request advances `num_computed_tokens`
toward `num_tokens`; long prompts are therefore chunked and share steps with decodes. When the
pool runs dry, the newest running request (FCFS) or the lowest-priority one is preempted:
its blocks are freed and it is recomputed later. Admission requires blocks for the whole
prompt, so admitted prefills do not thrash.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.encoder_cache_manager import EncoderCacheManager
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.sched_output import EngineCoreOutput, NewRequestData, SchedulerOutput
from pagedlm.runner_outputs import ModelRunnerOutput
from pagedlm.structured_output import advance_grammar


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters since the last `reset()` (for the vllm:spec_decode_*
    metrics): drafts verified, draft tokens, accepted tokens, accepted tokens per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def reset(self) -> SpecDecodingStats:
        out = SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )
        self.__init__()
        return out


class RequestQueue:
    """Waiting requests: a FIFO deque, or a heap on (priority, arrival_time, request_id)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
        else:
            self._fifo.append(request)

    def prepend(self, request: Request) -> None:
        """Preempted requests go back first (under priority the heap orders them anyway)."""
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
        else:
            self._fifo.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap) if self.policy == "priority" else self._fifo.popleft()

    def remove(self, requests: Iterable[Request]) -> None:
        doomed = set(id(r) for r in requests)
        if self.policy == "priority":
            self._heap = [r for r in self._heap if id(r) not in doomed]
            heapq.heapify(self._heap)
        else:
            self._fifo = deque(r for r in self._fifo if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._heap) + len(self._fifo)

    def __iter__(self):
        return iter(sorted(self._heap) if self.policy == "priority" else self._fifo)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        max_loras: int | None = None,
    ) -> None:
        self.config = scheduler_config
        self.max_loras = max_loras  # None: LoRA disabled
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = scheduler_config.max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.preempted_outside_step: set[str] = set()  # told to the workers next step
        self.num_preemptions = 0
        self.spec_decoding_stats = SpecDecodingStats()
        # Images: at most `encoder_budget` embedding rows encoded a step, and cached on the
        # workers; any image of an admissible prompt fits both.
        self.encoder_budget = max(scheduler_config.max_num_batched_tokens, self.max_model_len)
        self.encoder_cache_manager = EncoderCacheManager(self.encoder_budget)

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, stop string found by detokenizer)."""
        doomed = [self.requests[r] for r in request_ids if r in self.requests]
        doomed = [r for r in doomed if not r.is_finished()]
        waiting = [r for r in doomed if r.status != RequestStatus.RUNNING]
        self.waiting.remove(waiting)
        for request in doomed:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        scheduled: list[Request] = []
        preempted = False
        self._encoder_budget_left = self.encoder_budget

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens_with_spec - request.num_computed_tokens
            if threshold > 0:
                num_new = min(num_new, threshold)
            # drafts never reach past the last position the model allows
            num_new = min(num_new, budget, self.max_model_len - request.num_computed_tokens)
            encoder_inputs, num_new = self._schedule_encoder_inputs(
                request, request.num_computed_tokens, num_new
            )
            if num_new <= 0:
                i += 1
                continue
            num_slots = num_new + self._lookahead(request.num_computed_tokens + num_new)
            while self.kv_cache_manager.allocate_slots(request, num_slots) is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                if victim.request_id in out.num_scheduled_tokens:
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
                    out.scheduled_spec_decode_tokens.pop(victim.request_id, None)
                    scheduled.remove(victim)
                if victim_index < i:
                    i -= 1
                self._preempt(victim)
                out.preempted_req_ids.add(victim.request_id)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(request)
                out.num_scheduled_tokens[request.request_id] = num_new
                self._allocate_encoder_inputs(request, encoder_inputs, out)
                num_drafts = request.num_computed_tokens + num_new - request.num_tokens
                if num_drafts > 0:
                    drafts = request.spec_token_ids[:num_drafts]
                    out.scheduled_spec_decode_tokens[request.request_id] = drafts
                request.spec_token_ids = []
                budget -= num_new
                i += 1
            # When the request preempted itself (priority policy: it was the lowest), index i
            # now points at the next running request, which may still fit without new blocks.

        if not preempted or not scheduled:
            budget = self._admit_waiting(out, scheduled, budget, threshold)

        # an image scheduled for a request preempted later in this step is still encoded (the
        # workers keep a preempted request's data) unless its entry was evicted meanwhile
        cached = self.encoder_cache_manager.cached
        for rid, indices in list(out.scheduled_encoder_inputs.items()):
            features = self.requests[rid].mm_features
            kept = [i for i in indices if features[i].identifier in cached]
            if kept:
                out.scheduled_encoder_inputs[rid] = kept
            else:
                del out.scheduled_encoder_inputs[rid]
        out.free_encoder_mm_hashes = self.encoder_cache_manager.get_freed_mm_hashes()
        now = time.monotonic()
        for request in scheduled:
            out.num_computed_tokens[request.request_id] = request.num_computed_tokens
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
            if not request.scheduled_ts:
                request.scheduled_ts = now
            self._describe_for_workers(request, out)
        out.scheduled_req_ids = [r.request_id for r in scheduled]
        out.finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        out.preempted_req_ids |= self.preempted_outside_step - out.finished_req_ids
        self.preempted_outside_step = set()
        return out

    def _describe_for_workers(self, request: Request, out: SchedulerOutput) -> None:
        """Add the request to `out` as new (whole) or cached (what changed since last sent)."""
        rid = request.request_id
        block_ids = self.kv_cache_manager.get_block_ids(rid)
        computed = out.num_computed_tokens[rid]
        if not request.sent_to_workers:
            out.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=rid,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    pooling_params=request.pooling_params,
                    block_ids=block_ids,
                    num_computed_tokens=computed,
                    token_type_ids=request.token_type_ids,
                    lora_request=request.lora_request,
                    output_token_ids=list(request.output_token_ids),
                    mm_features=request.mm_features,
                )
            )
            request.sent_to_workers = True
        else:
            cached = out.scheduled_cached_reqs
            resumed = request.resumed_from_preemption
            cached.req_ids.append(rid)
            cached.resumed_from_preemption.append(resumed)
            cached.new_token_ids.append(request.all_token_ids[request.num_synced_tokens :])
            cached.new_block_ids.append(
                block_ids if resumed else block_ids[request.num_synced_blocks :]
            )
            cached.num_computed_tokens.append(computed)
        request.resumed_from_preemption = False
        request.num_synced_tokens = request.num_tokens
        request.num_synced_blocks = len(block_ids)

    def _admit_waiting(
        self, out: SchedulerOutput, scheduled: list[Request], budget: int, threshold: int
    ) -> int:
        # LoRA: the running requests' adapters plus admitted ones stay within max_loras;
        # a request of another adapter waits (skipped, keeping its place in the queue).
        loras = self._running_lora_ids() if self.max_loras is not None else set()
        skipped: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            lora = request.lora_request
            if (
                lora is not None
                and self.max_loras is not None
                and lora.lora_int_id not in loras
                and len(loras) >= self.max_loras
            ):
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if threshold > 0:
                num_new = min(num_new, threshold)
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            wanted = num_new
            encoder_inputs, num_new = self._schedule_encoder_inputs(
                request, num_hit_tokens, num_new
            )
            if num_new <= 0 or (num_new < wanted and not self.config.enable_chunked_prefill):
                break
            allocated = self.kv_cache_manager.allocate_slots(
                request,
                num_new + self._lookahead(num_hit_tokens + num_new),
                hits,
                num_hit_tokens,
                num_tokens_must_fit=request.num_tokens,
            )
            if allocated is None:
                break
            # Register the blocks this step fills now, as vLLM does: requests admitted later in
            # this step then share them (each layer writes all new KV before attending).
            self.kv_cache_manager.cache_blocks(request, num_hit_tokens + num_new)
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            self._allocate_encoder_inputs(request, encoder_inputs, out)
            budget -= num_new
            if lora is not None:
                loras.add(lora.lora_int_id)
        for request in reversed(skipped):
            self.waiting.prepend(request)
        return budget

    def _schedule_encoder_inputs(
        self, request: Request, start: int, num_new: int
    ) -> tuple[list[int], int]:
        """(indices of the request's images to encode this step, tokens to schedule): the
        tokens stop before an image that cannot be encoded now (encoder budget or cache
        space), and, with `disable_chunked_mm_input`, before an image that would be cut."""
        if not request.mm_features:
            return [], num_new
        manager = self.encoder_cache_manager
        end = start + num_new
        indices: list[int] = []
        reserved = 0
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset >= end:
                break
            if position.end <= start:
                continue
            if self.config.disable_chunked_mm_input and position.end > end:
                return indices, max(position.offset - start, 0)
            if manager.check_and_update_cache(request, index):
                continue
            if feature.num_embeds > self._encoder_budget_left - reserved or not (
                manager.can_allocate(request, index, reserved)
            ):
                return indices, max(position.offset - start, 0)
            reserved += feature.num_embeds
            indices.append(index)
        return indices, num_new

    def _allocate_encoder_inputs(
        self, request: Request, indices: list[int], out: SchedulerOutput
    ) -> None:
        """The scheduled request's images to encode: cached from now, sent to the workers."""
        if not indices:
            return
        for index in indices:
            self.encoder_cache_manager.allocate(request, index)
            self._encoder_budget_left -= request.mm_features[index].num_embeds
        out.scheduled_encoder_inputs[request.request_id] = indices

    def _free_encoder_inputs(self, request: Request) -> None:
        """Release the images whose placeholder tokens are all computed."""
        for index, feature in enumerate(request.mm_features):
            if feature.mm_position.end <= request.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, index)

    def _running_lora_ids(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request}

    def _lookahead(self, end: int) -> int:
        """KV slots past position `end` (this step's last + 1) that a draft model will write,
        within the model's positions."""
        return max(0, min(self.config.num_lookahead_tokens, self.max_model_len - end))

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, keep the tokens, wait at the front."""
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.resumed_from_preemption = request.sent_to_workers
        request.spec_token_ids = []
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # -------------------------------------------------------------- update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops, cache full blocks, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for rid in scheduler_output.scheduled_req_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue  # finished outside the step (abort) while the step ran
            new_token_ids = runner_output.sampled_token_ids.get(rid, [])
            prompt_logprobs = runner_output.prompt_logprobs.get(rid)
            pooler_output = runner_output.pooler_output.get(rid)
            stopped = False
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if drafts and new_token_ids:
                # rejected drafts' KV is recomputed: roll the computed count back over them
                num_accepted = len(new_token_ids) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_decoding_stats.observe(len(drafts), num_accepted)
            if new_token_ids:
                new_token_ids, stopped = self._append_and_check_stop(request, new_token_ids)
                if not request.first_token_ts:
                    request.first_token_ts = now
                request.last_token_ts = now
            elif pooler_output is not None:
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            if request.mm_features:
                self._free_encoder_inputs(request)
            if stopped:
                self.running.remove(request)
                self._free_request(request)
            else:
                request.spec_token_ids = runner_output.spec_token_ids.get(rid, [])
            # a request that stopped inside its accepted drafts keeps the entries of its tokens
            logprobs = runner_output.logprobs.get(rid)
            if logprobs is not None:
                logprobs = logprobs.first(len(new_token_ids))
            mask = runner_output.sampling_mask.get(rid)
            if mask is not None:
                mask = mask[: len(new_token_ids)]
            if new_token_ids or prompt_logprobs is not None or stopped:
                outputs.append(
                    EngineCoreOutput(
                        request_id=rid,
                        new_token_ids=new_token_ids,
                        finish_reason=request.get_finished_reason() if stopped else None,
                        stop_reason=request.stop_reason,
                        new_logprobs=logprobs,
                        new_prompt_logprobs=prompt_logprobs,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        pooling_output=pooler_output,
                        scheduled_ts=request.scheduled_ts,
                        new_sampling_mask=mask,
                    )
                )
        return outputs

    def _append_and_check_stop(
        self, request: Request, token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append tokens one at a time, checking the stop conditions after each: a request may
        get several (speculative decoding) and must stop at the first that ends it."""
        for i, token_id in enumerate(token_ids):
            request.append_output_token_ids([token_id])
            stopped = self._check_stop(request)
            if not stopped and advance_grammar(request, [token_id]):  # structured outputs:
                request.status = RequestStatus.FINISHED_STOPPED  # the grammar has ended
                stopped = True
            if stopped:
                return token_ids[: i + 1], True
        return token_ids, False

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        assert params is not None
        if request.num_output_tokens >= params.min_tokens:
            last = request.output_token_ids[-1]
            if not params.ignore_eos and last == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if request.num_tokens >= self.max_model_len or (
            request.num_output_tokens >= request.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ------------------------------------------------------------- control
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if reset_running_requests:
            self.preempted_outside_step |= self._preempt_running()
        return self.kv_cache_manager.reset_prefix_cache()

    def _preempt_running(self) -> set[str]:
        """Preempt every running request (they keep their order at the front of the queue)."""
        ids = {r.request_id for r in self.running}
        for request in reversed(self.running):
            self._preempt(request)
        self.running.clear()
        return ids

    def recover_from_failed_step(self, failed_ids: list[str]) -> None:
        """After a step that raised: `failed_ids` finish with an error; every other request is
        recomputed and re-sent to the workers whole (they forget their requests, whose state
        the failed step may have left half-updated); the prefix cache is invalidated, as the
        step may have registered blocks it never wrote."""
        self.finish_requests(failed_ids, RequestStatus.FINISHED_ERROR)
        self._preempt_running()
        self.preempted_outside_step = set()
        for request in self.requests.values():
            request.sent_to_workers = False
            request.resumed_from_preemption = False
        self.kv_cache_manager.invalidate_prefix_cache()
        self.encoder_cache_manager.reset()  # the workers drop their encoder outputs too

    def reset_encoder_cache(self) -> None:
        """Evict every encoder output no request is using (reset_mm_cache); the workers drop
        them with the next step."""
        self.encoder_cache_manager.evict_unused()

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants()
        self.encoder_cache_manager.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        assert self.max_loras is None or len(self._running_lora_ids()) <= self.max_loras
        for request in self.running:
            assert request.num_computed_tokens <= request.num_tokens
            held = len(self.kv_cache_manager.req_to_blocks.get(request.request_id, []))
            assert held * self.kv_cache_manager.block_size >= request.num_computed_tokens
