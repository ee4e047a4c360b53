"""Step inputs built with numpy from the scheduler's decision (no Python loop per token).

Batch order: requests with one new token (decodes) first, then prefill chunks; the attention
backend relies on it. `logits_indices[i]` is the flat token row whose logits sample request i
of `sampling_requests`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedlm.attention.backend import CommonAttentionMetadata
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request
from pagedlm.core.sched_output import SchedulerOutput


@dataclass
class StepInputs:
    requests: list[Request]  # batch order
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    token_type_ids: np.ndarray | None  # [num_tokens] int64, for encoders with segment ids
    attn: CommonAttentionMetadata
    sampling_requests: list[Request]  # requests whose last scheduled token is sampled
    logits_indices: np.ndarray  # [len(sampling_requests)] int64
    query_starts: dict[str, tuple[int, int, int]]  # req_id -> (row start, num tokens, position)


def build_step_inputs(
    scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager
) -> StepInputs:
    num_sched = scheduler_output.num_scheduled_tokens
    computed = scheduler_output.num_computed_tokens
    requests = sorted(
        scheduler_output.scheduled_requests, key=lambda r: num_sched[r.request_id] != 1
    )
    num_reqs = len(requests)
    query_lens = np.fromiter((num_sched[r.request_id] for r in requests), np.int64, num_reqs)
    starts = np.fromiter((computed[r.request_id] for r in requests), np.int64, num_reqs)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # positions: start of each request + offset within its query
    req_index = np.repeat(np.arange(num_reqs), query_lens)
    offsets = np.arange(num_tokens) - query_start_loc[req_index]
    positions = starts[req_index] + offsets

    token_chunks = []
    for r, start, n in zip(requests, starts.tolist(), query_lens.tolist()):
        token_chunks.append(r.all_token_ids[start : start + n])
    input_ids = np.fromiter(
        (t for chunk in token_chunks for t in chunk), dtype=np.int64, count=num_tokens
    )

    block_ids = [kv_cache_manager.get_block_ids(r.request_id) for r in requests]
    max_blocks = max((len(b) for b in block_ids), default=1)
    block_table = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        block_table[i, : len(ids)] = ids
    block_size = kv_cache_manager.block_size
    slot_mapping = (
        block_table[req_index, positions // block_size] * block_size + positions % block_size
    )

    num_decodes = int(np.argmax(query_lens != 1)) if (query_lens != 1).any() else num_reqs
    sampling = [
        i
        for i, r in enumerate(requests)
        if seq_lens[i] == r.num_tokens and r.sampling_params is not None
    ]
    token_type_ids = None
    if any(r.token_type_ids is not None for r in requests):
        token_type_ids = np.fromiter(
            (
                t
                for r, start, n in zip(requests, starts.tolist(), query_lens.tolist())
                for t in (r.token_type_ids or [0] * r.num_tokens)[start : start + n]
            ),
            dtype=np.int64,
            count=num_tokens,
        )
    return StepInputs(
        requests=requests,
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
        sampling_requests=[requests[i] for i in sampling],
        logits_indices=query_start_loc[1:][sampling] - 1,
        query_starts={
            r.request_id: (int(query_start_loc[i]), int(query_lens[i]), int(starts[i]))
            for i, r in enumerate(requests)
        },
    )
