"""The worker's persistent batch: per-request state kept across steps, in numpy rows.

Invariants: rows [0, num_reqs) hold exactly the requests in the batch (a removed row is filled
by the last one, so rows stay dense); `token_ids[row, :num_tokens[row]]` are the request's
prompt + output tokens as the scheduler last sent them; `block_table[row, :num_blocks[row]]`
its KV blocks. Sampling parameters are written into their arrays once, when a request joins,
so building a step's sampling metadata slices arrays instead of looping over requests;
`lora_id[row]` is the row's LoRA adapter id (0: none), spread to the step's tokens.
A request preempted by the scheduler leaves the batch but keeps its `CachedRequestState`
(tokens, seeded generator) until it finishes; so does every request after `reset_rows()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.exceptions import blame_request
from pagedlm.lora.request import LoRARequest
from pagedlm.multimodal.inputs import MultiModalFeatureSpec
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What a worker knows of one request (built from `NewRequestData`, then diffs)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    block_ids: list[int]
    num_computed_tokens: int
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None
    # prompt positions whose prompt logprobs were sent: a preempted request recomputes its
    # prompt, and those are not sent twice
    num_prompt_logprobs_sent: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)  # its images
    # M-RoPE: [3, num_prompt_tokens] positions of the prompt; a later token i has i + delta
    mrope_positions: np.ndarray | None = None
    mrope_position_delta: int = 0

    def __post_init__(self) -> None:
        params = self.sampling_params
        if params is not None and params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Requests being run, one numpy row each; see the module docstring for the invariants."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, vocab_size: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.requests: dict[str, CachedRequestState] = {}  # in the batch or preempted
        self.req_ids: list[str] = []  # row -> request id
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState] = []
        # np.zeros maps pages lazily: rows cost memory only as tokens are written.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Sampling parameters, one entry per row (neutral values for pooling requests).
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)  # 0 = greedy
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)  # vocab_size = disabled
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1 = none asked
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Rows whose request needs a per-request look when sampled (seed, sparse processors).
        self.needs_visit = np.zeros(max_num_reqs, dtype=bool)
        self.lora_id = np.zeros(max_num_reqs, dtype=np.int64)  # LoRA adapter id, 0 = none
        self._row_arrays = [
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.num_blocks,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.num_logprobs,
            self.min_tokens,
            self.needs_visit,
            self.lora_id,
        ]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ------------------------------------------------------------ membership
    def add_request(self, state: CachedRequestState) -> int:
        """Append the request as the last row; returns the row."""
        row = len(self.req_ids)
        assert row < self.max_num_reqs, "more requests than max_num_seqs"
        assert state.req_id not in self.req_id_to_index, state.req_id
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.req_id_to_index[state.req_id] = row
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table[row, : len(state.block_ids)] = state.block_ids
        self.num_blocks[row] = len(state.block_ids)
        self._write_sampling_params(row, state.sampling_params)
        self.lora_id[row] = state.lora_request.lora_int_id if state.lora_request else 0
        return row

    def _write_sampling_params(self, row: int, p: SamplingParams | None) -> None:
        if p is None:  # pooling: neutral values, never sampled
            p = SamplingParams(temperature=0.0)
        self.temperature[row] = p.temperature  # 0.0: greedy (normalized at admission)
        self.top_k[row] = p.top_k if p.top_k > 0 else self.vocab_size
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        k = p.num_logprobs  # logprobs, else len(logprob_token_ids)
        self.num_logprobs[row] = -1 if k is None else k
        self.min_tokens[row] = p.min_tokens
        self.needs_visit[row] = bool(
            p.seed is not None
            or p.allowed_token_ids
            or p.bad_words_token_ids
            or p.logit_bias
            or p.min_tokens
            or p.logprob_token_ids
        )

    def remove_request(self, req_id: str) -> None:
        """Drop the request's row; the last row moves into the hole (rows stay dense)."""
        row = self.req_id_to_index.pop(req_id)
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            nb = int(self.num_blocks[last])
            self.block_table[row, :nb] = self.block_table[last, :nb]
            for array in self._row_arrays:
                array[row] = array[last]
            self.req_ids[row] = moved
            self.states[row] = self.states[last]
            self.req_id_to_index[moved] = row
        self.req_ids.pop()
        self.states.pop()

    def reset_rows(self) -> None:
        """Empty the batch after a failed step; request states stay (generators, prompt
        logprobs sent) for the requests that the scheduler sends again whole."""
        self.req_ids.clear()
        self.req_id_to_index.clear()
        self.states.clear()

    # ---------------------------------------------------------------- diffs
    def apply(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diff: drop finished and preempted rows, add new and resumed
        requests, append new tokens and blocks, record each row's computed-token count."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            if req_id in self.req_id_to_index:
                self.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            if req_id in self.req_id_to_index:
                self.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            with blame_request(new.req_id):
                known = self.requests.get(new.req_id)  # re-sent whole after reset_rows()
                state = CachedRequestState(
                    req_id=new.req_id,
                    prompt_token_ids=list(new.prompt_token_ids),
                    sampling_params=new.sampling_params,
                    pooling_params=new.pooling_params,
                    block_ids=list(new.block_ids),
                    num_computed_tokens=new.num_computed_tokens,
                    token_type_ids=new.token_type_ids,
                    lora_request=new.lora_request,
                    output_token_ids=list(new.output_token_ids),
                    generator=known.generator if known is not None else None,
                    mm_features=new.mm_features,
                )
                if known is not None:
                    state.num_prompt_logprobs_sent = known.num_prompt_logprobs_sent
                self.requests[new.req_id] = state
                self.add_request(state)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            new_tokens, new_blocks = cached.new_token_ids[i], cached.new_block_ids[i]
            state.output_token_ids.extend(new_tokens)
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(new_blocks)
                self.add_request(state)
                continue
            state.block_ids.extend(new_blocks)
            row = self.req_id_to_index[req_id]
            if new_tokens:
                self.append_token_ids(row, new_tokens)
            if new_blocks:
                self.append_block_ids(row, new_blocks)
        for req_id, n in so.num_computed_tokens.items():
            self.num_computed_tokens[self.req_id_to_index[req_id]] = n
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # drafts sit after the last token for this step only (num_tokens excludes them)
            row = self.req_id_to_index[req_id]
            start = int(self.num_tokens[row])
            self.token_ids[row, start : start + len(drafts)] = drafts

    def append_token_ids(self, row: int, token_ids: list[int]) -> None:
        start = int(self.num_tokens[row])
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    # ------------------------------------------------------------- queries
    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter(
            (self.req_id_to_index[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()

    def prompt_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, : self.num_prompt_tokens[row]].tolist()
