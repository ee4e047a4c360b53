"""One step's model inputs, gathered with numpy from the persistent batch (no loop per token).

Batch order: requests with one new token (decodes) first, then prefill chunks; the attention
backend relies on it. A request samples when the step reaches its last token; with
speculative drafts it needs the logits of its last `num_logits[i]` = drafts + 1 rows, so
`logits_indices` lists, request after request, `num_logits[i]` consecutive rows of the model's
output for request `sampling_rows[i]` of the persistent batch.

Output rows: the rows whose hidden states the step uses, per request a suffix of its query (the
sampled rows; every row for prompt logprobs and for pooling, except that a LAST pooler reads
the prompt's last row alone, in the step that ends the prompt; none for a prompt chunk that
neither samples, scores nor pools; a step that would use none keeps its last row). With
`select_outputs`, a step without LoRA adapters, with a query of several rows that uses fewer
rows than it computes has the model's last layer compute only those (`output_rows`), and
`logits_indices` and `output_spans` index the model's output rows; otherwise they index token
rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedlm.attention.backend import CommonAttentionMetadata, num_leading_decodes
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
    output_rows: np.ndarray | None  # [num_outputs] token rows the model outputs; None: all
    sampling_rows: np.ndarray  # persistent rows of the requests sampled this step
    sampling_states: list[CachedRequestState]  # their states, same order
    logits_indices: np.ndarray  # [num_logits.sum()] int64, rows of the model's output
    num_logits: np.ndarray  # [len(sampling_rows)] logits rows per sampled request
    # req_id -> (first output row, number of output rows, position of that row's token)
    output_spans: dict[str, tuple[int, int, int]]


def suffix_rows(ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The last lengths[i] rows before ends[i], request after request."""
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(ends - lengths, lengths) + within


def _output_lens(
    states: list[CachedRequestState],
    query_lens: np.ndarray,
    pooled: np.ndarray,
    sampling: np.ndarray,
    num_logits: np.ndarray,
    reaches_last_token: np.ndarray,
    pool_last_row: bool,
) -> np.ndarray:
    """Per request, how many trailing query rows the step uses (see the module docstring)."""
    scored = np.fromiter(
        (
            s.sampling_params is not None and s.sampling_params.prompt_logprobs is not None
            for s in states
        ),
        bool,
        len(states),
    )
    lens = np.where(scored | pooled, query_lens, 0)
    if pool_last_row:  # the step that ends a prompt pools its last row; earlier chunks none
        lens[pooled] = reaches_last_token[pooled]
    lens[sampling] = np.maximum(lens[sampling], num_logits)
    if not lens.any():  # keep one row anyway: no kernel is ever given an empty batch
        lens[-1] = 1
    return lens


def build_step_inputs(
    batch: InputBatch,
    scheduler_output: SchedulerOutput,
    block_size: int,
    select_outputs: bool = False,
    pool_last_row: bool = False,
) -> StepInputs:
    """`select_outputs`: the model can compute its last layer for the output rows only (not
    done in a step with LoRA adapters, whose per-token mapping covers every row);
    `pool_last_row`: its pooler reads each prompt's last row only."""
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
    num_decodes = num_leading_decodes(query_lens)
    states = [batch.states[r] for r in rows.tolist()]
    # A request samples when this step reaches its last token (not pooling requests); any
    # positions past it hold draft tokens to verify.
    num_drafts = seq_lens - batch.num_tokens[rows]
    reaches_last_token = num_drafts >= 0
    # a request is generated (it has sampling params) or pooled (it has pooling params instead)
    pooled = np.fromiter((s.sampling_params is None for s in states), dtype=bool, count=num_reqs)
    sampling = reaches_last_token & ~pooled
    num_logits = num_drafts[sampling] + 1
    output_rows = output_lens = None
    output_ends, num_outputs = query_start_loc[1:], query_lens
    # not when every query is one row, nor with adapters
    if select_outputs and num_tokens > num_reqs and not batch.lora_id[rows].any():
        output_lens = _output_lens(
            states, query_lens, pooled, sampling, num_logits, reaches_last_token, pool_last_row
        )
        if int(output_lens.sum()) < num_tokens:
            output_rows = suffix_rows(output_ends, output_lens)
            output_ends, num_outputs = np.cumsum(output_lens), output_lens
        else:
            output_lens = None
    token_type_ids = None
    if any(s.token_type_ids is not None for s in states):
        token_type_ids = np.concatenate(
            [
                np.asarray(s.token_type_ids or [0] * s.num_tokens, dtype=np.int64)[
                    start : start + n
                ]
                for s, start, n in zip(states, starts.tolist(), query_lens.tolist(), strict=True)
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
            output_query_lens=output_lens,
        ),
        output_rows=output_rows,
        sampling_rows=rows[sampling],
        sampling_states=[
            s for s, sampled in zip(states, sampling.tolist(), strict=True) if sampled
        ],
        logits_indices=suffix_rows(output_ends[sampling], num_logits),
        num_logits=num_logits,
        output_spans={
            s.req_id: (int(output_ends[i] - n), int(n), int(seq_lens[i] - n))
            for i, (s, n) in enumerate(zip(states, num_outputs.tolist(), strict=True))
        },
    )
