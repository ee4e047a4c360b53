"""One step's model inputs, gathered with numpy from the persistent batch (no loop per token).

Batch order: requests with one new token (decodes) first, then prefill chunks; the attention
backend relies on it. A request samples when the step reaches its last token; with
speculative drafts it needs the logits of its last `num_logits[i]` = drafts + 1 rows, so
`logits_indices` lists, request after request, `num_logits[i]` consecutive token rows for
request `sampling_rows[i]` of the persistent batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedlm.attention.backend import CommonAttentionMetadata
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class StepInputs:
    rows: np.ndarray  # [num_reqs] persistent-batch rows, in step order
    states: list[CachedRequestState]  # step order
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    token_type_ids: np.ndarray | None  # [num_tokens] int64, for encoders with segment ids
    attn: CommonAttentionMetadata
    sampling_rows: np.ndarray  # persistent rows of the requests sampled this step
    sampling_states: list[CachedRequestState]  # their states, same order
    logits_indices: np.ndarray  # [num_logits.sum()] int64
    num_logits: np.ndarray  # [len(sampling_rows)] logits rows per sampled request
    query_starts: dict[str, tuple[int, int, int]]  # req_id -> (row start, num tokens, position)


def build_step_inputs(
    batch: InputBatch, scheduler_output: SchedulerOutput, block_size: int
) -> StepInputs:
    num_sched = scheduler_output.num_scheduled_tokens
    req_ids = scheduler_output.scheduled_req_ids
    rows = batch.rows_of(req_ids)
    query_lens = np.fromiter((num_sched[r] for r in req_ids), np.int64, len(req_ids))
    order = np.argsort(query_lens != 1, kind="stable")  # decodes first
    rows, query_lens = rows[order], query_lens[order]
    num_reqs = len(rows)
    seq_lens = batch.num_computed_tokens[rows] + query_lens
    starts = seq_lens - query_lens
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # positions: start of each request + offset within its query
    req_index = np.repeat(np.arange(num_reqs), query_lens)
    positions = starts[req_index] + np.arange(num_tokens) - query_start_loc[req_index]
    token_rows = rows[req_index]
    input_ids = batch.token_ids[token_rows, positions].astype(np.int64)
    max_blocks = max(int(batch.num_blocks[rows].max(initial=1)), 1)
    block_table = batch.block_table[rows, :max_blocks]
    slot_mapping = (
        block_table[req_index, positions // block_size] * block_size + positions % block_size
    )
    num_decodes = int(np.argmax(query_lens != 1)) if (query_lens != 1).any() else num_reqs
    states = [batch.states[r] for r in rows.tolist()]
    # A request samples when this step reaches its last token (not pooling requests); any
    # positions past it hold draft tokens to verify.
    num_drafts = seq_lens - batch.num_tokens[rows]
    sampling = (num_drafts >= 0) & np.fromiter(
        (s.sampling_params is not None for s in states), dtype=bool, count=num_reqs
    )
    num_logits = num_drafts[sampling] + 1
    first_logit = query_start_loc[1:][sampling] - num_logits
    within = np.arange(int(num_logits.sum())) - np.repeat(
        np.cumsum(num_logits) - num_logits, num_logits
    )
    token_type_ids = None
    if any(s.token_type_ids is not None for s in states):
        token_type_ids = np.concatenate(
            [
                np.asarray(s.token_type_ids or [0] * s.num_tokens, dtype=np.int64)[
                    start : start + n
                ]
                for s, start, n in zip(states, starts.tolist(), query_lens.tolist())
            ]
        )
    return StepInputs(
        rows=rows,
        states=states,
        input_ids=input_ids,
        positions=positions,
        token_type_ids=token_type_ids,
        attn=CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
        ),
        sampling_rows=rows[sampling],
        sampling_states=[s for s, sampled in zip(states, sampling.tolist()) if sampled],
        logits_indices=np.repeat(first_logit, num_logits) + within,
        num_logits=num_logits,
        query_starts={
            s.req_id: (int(query_start_loc[i]), int(query_lens[i]), int(starts[i]))
            for i, s in enumerate(states)
        },
    )
