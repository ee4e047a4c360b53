"""CPUAttentionBackend against a dense fp32 reference with explicit masks; step-input layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedlm.attention.backend import CommonAttentionMetadata
from pagedlm.attention.cpu_attn import CPUAttentionBackend
from pagedlm.core.sched_output import NewRequestData, SchedulerOutput
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import SamplingParams
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.step_inputs import build_step_inputs

HEAD_SIZE = 8
ATOL = RTOL = 1e-5


def reference_attention(
    q: torch.Tensor,  # [n, heads, d]: the last n positions of the sequence
    k: torch.Tensor,  # [seq_len, kv_heads, d]
    v: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    n, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    mask = torch.full((n, seq_len), float("-inf"), dtype=torch.float64)
    for i in range(n):
        q_pos = seq_len - n + i
        for k_pos in range(seq_len):
            if k_pos <= q_pos and (window is None or q_pos - k_pos < window):
                mask[i, k_pos] = 0.0
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale + mask
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


def run_case(
    specs: list[tuple[int, int]],  # (tokens already in the cache, new tokens), batch order
    num_heads: int = 4,
    num_kv_heads: int = 2,
    block_size: int = 4,
    window: int | None = None,
    seed: int = 0,
    pad_rows: int = 0,
    output_lens: list[int] | None = None,
) -> None:
    """`output_lens`: attend only each request's last output_lens[i] query rows, as a model's
    last layer does (the keys/values of every token are still written)."""
    gen = torch.Generator().manual_seed(seed)
    num_decodes = 0
    while num_decodes < len(specs) and specs[num_decodes][1] == 1:
        num_decodes += 1
    assert all(n != 1 for _, n in specs[num_decodes:]), "decodes must come first"
    seq_lens = [c + n for c, n in specs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # some blocks nobody uses
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for nb in blocks_per_req:
        tables.append(perm[at : at + nb])
        at += nb

    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, HEAD_SIZE)
    full_k = [torch.randn(s, num_kv_heads, HEAD_SIZE, generator=gen) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, HEAD_SIZE, generator=gen) for s in seq_lens]
    queries = [torch.randn(n, num_heads, HEAD_SIZE, generator=gen) for _, n in specs]

    def slot(req: int, pos: int) -> int:
        return tables[req][pos // block_size] * block_size + pos % block_size

    for r, (computed, _) in enumerate(specs):
        for pos in range(computed):
            block, offset = divmod(slot(r, pos), block_size)
            kv_cache[0, block, offset] = full_k[r][pos]
            kv_cache[1, block, offset] = full_v[r][pos]
    before = kv_cache.clone()

    query_lens = [n for _, n in specs]
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    block_table = np.zeros((len(specs), max(blocks_per_req)), dtype=np.int64)
    for r, table in enumerate(tables):
        block_table[r, : len(table)] = table
    slot_mapping = np.array(
        [slot(r, pos) for r, (c, n) in enumerate(specs) for pos in range(c, c + n)], np.int64
    )
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=np.array(seq_lens, dtype=np.int64),
        block_table=block_table,
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        output_query_lens=None if output_lens is None else np.array(output_lens, np.int64),
    )
    if output_lens is not None:
        queries = [q[len(q) - n :] for q, n in zip(queries, output_lens, strict=True)]
    query = torch.cat(queries)
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, specs, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, specs, strict=True)])
    if pad_rows:  # inputs padded past the real tokens (as for a captured graph)
        query = torch.cat([query, torch.randn(pad_rows, num_heads, HEAD_SIZE, generator=gen)])
        key = torch.cat([key, torch.randn(pad_rows, num_kv_heads, HEAD_SIZE, generator=gen)])
        value = torch.cat([value, torch.randn(pad_rows, num_kv_heads, HEAD_SIZE, generator=gen)])

    expected = torch.cat(
        [
            reference_attention(q, k, v, HEAD_SIZE**-0.5, window)
            for q, k, v in zip(queries, full_k, full_v, strict=True)
        ]
    )
    num_tokens = int(query_start_loc[-1])
    num_rows = num_tokens if output_lens is None else sum(output_lens)
    # the PyTorch path, then the C kernels (when built) on a fresh copy of the cache
    cache_before_step = kv_cache.clone()
    for use_c_kernel in (False, None):
        kv_cache.copy_(cache_before_step)
        backend = CPUAttentionBackend(use_c_kernel=use_c_kernel)
        metadata = backend.build(common, torch.device("cpu"))
        out = backend.forward(query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5, window)
        assert out.shape == query.shape
        torch.testing.assert_close(out[:num_rows], expected, atol=ATOL, rtol=RTOL)

    # The new keys/values landed at their slots; nothing else in the cache changed.
    flat = kv_cache.view(2, -1, num_kv_heads, HEAD_SIZE)
    slots = torch.from_numpy(slot_mapping)
    torch.testing.assert_close(flat[0, slots], key[:num_tokens], atol=0, rtol=0)
    torch.testing.assert_close(flat[1, slots], value[:num_tokens], atol=0, rtol=0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    flat_before = before.view(2, -1, num_kv_heads, HEAD_SIZE)
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 4), (4, 1)])
def test_prefills_unequal_lengths(num_heads: int, num_kv_heads: int) -> None:
    run_case([(0, 5), (0, 8), (0, 13), (0, 2)], num_heads, num_kv_heads)


@pytest.mark.parametrize("length", [4, 8, 5, 9, 12, 13])  # len % block_size in {0, 1}
def test_prefill_block_boundaries(length: int) -> None:
    run_case([(0, length), (0, 3)])


@pytest.mark.parametrize("computed, query_len", [(4, 3), (8, 5), (5, 4), (7, 2), (3, 9), (1, 12)])
def test_chunk_after_cached_prefix(computed: int, query_len: int) -> None:
    run_case([(computed, query_len), (0, 6)])


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 4)])
def test_pure_decode_batch(num_heads: int, num_kv_heads: int) -> None:
    # seq_lens 1, 4, 5, 8, 9, 17: one token prompts and len % block_size in {0, 1}
    run_case([(0, 1), (3, 1), (4, 1), (7, 1), (8, 1), (16, 1)], num_heads, num_kv_heads)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 4)])
def test_mixed_batch(num_heads: int, num_kv_heads: int) -> None:
    run_case(
        [(6, 1), (12, 1), (0, 1), (0, 7), (9, 3), (4, 4), (0, 2)],
        num_heads,
        num_kv_heads,
        seed=3,
    )


@pytest.mark.parametrize("block_size", [2, 3, 16])
def test_mixed_batch_block_sizes(block_size: int) -> None:
    run_case([(5, 1), (10, 1), (0, 11), (7, 6)], block_size=block_size, seed=block_size)


@pytest.mark.parametrize("window", [1, 3, 4, 6, 64])
def test_sliding_window(window: int) -> None:
    # decodes, a fresh prefill and a chunk after a cached prefix, all longer than the window
    run_case([(9, 1), (2, 1), (0, 10), (7, 5)], window=window, seed=window)


def test_sliding_window_pure_prefill() -> None:
    run_case([(0, 9), (0, 3)], window=4)


def test_padded_input_rows_are_ignored() -> None:
    run_case([(5, 1), (0, 6), (3, 4)], pad_rows=5)


@pytest.mark.parametrize(
    "specs, output_lens",
    [
        # decodes and prefills that sample (one row each): all through the decode path
        ([(6, 1), (12, 1), (0, 7), (9, 3)], [1, 1, 1, 1]),
        # a chunk that does not sample (0), a whole prompt scored (7) before a sampled one (1),
        # a chunk after a cached prefix with drafts (3 of 5 rows)
        ([(6, 1), (0, 1), (0, 7), (4, 4), (9, 5), (0, 2)], [1, 0, 7, 0, 3, 1]),
        ([(0, 9), (3, 4)], [0, 0]),  # no outputs: keys and values are still written
    ],
)
@pytest.mark.parametrize("window", [None, 3])
def test_output_rows_only(specs, output_lens, window) -> None:
    run_case(specs, window=window, output_lens=output_lens, seed=len(specs))


# ------------------------------------------------------------------- step inputs


def _tokens(request_id: str, num_tokens: int) -> list[int]:
    return [1000 * (ord(request_id) - ord("a") + 1) + i for i in range(num_tokens)]


def _batch(max_blocks: int = 8) -> InputBatch:
    return InputBatch(
        max_num_reqs=8, max_model_len=64, max_num_blocks_per_req=max_blocks, vocab_size=10_000
    )


def _new(request_id: str, num_tokens: int, block_ids: list[int], computed: int):
    return NewRequestData(
        req_id=request_id,
        prompt_token_ids=_tokens(request_id, num_tokens),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_ids=block_ids,
        num_computed_tokens=computed,
    )


def test_build_step_inputs_order_and_slot_mapping() -> None:
    bs = 4
    batch = _batch()
    num_sched = {"a": 6, "b": 1, "c": 3, "d": 1}
    computed = {"a": 0, "b": 9, "c": 4, "d": 4}
    so = SchedulerOutput(
        scheduled_new_reqs=[
            _new("a", 6, [7, 2], 0),  # prefill of its 6-token prompt
            _new("b", 10, [3, 9, 11], 9),  # decode: 9 computed, 1 new
            _new("c", 10, [0, 5], 4),  # chunk 4..6 (3 tokens) of a 10-token prompt: no sample
            _new("d", 5, [14, 6], 4),  # decode: 4 computed, 1 new (first slot of a new block)
        ],
        scheduled_req_ids=["a", "b", "c", "d"],
        num_scheduled_tokens=num_sched,
        num_computed_tokens=computed,
    )
    batch.apply(so)
    inputs = build_step_inputs(batch, so, bs)

    assert [s.req_id for s in inputs.states] == ["b", "d", "a", "c"]
    attn = inputs.attn
    assert attn.num_decodes == 2
    assert attn.query_start_loc.tolist() == [0, 1, 2, 8, 11]
    assert attn.seq_lens.tolist() == [10, 5, 6, 7]
    assert attn.block_table.tolist() == [[3, 9, 11], [14, 6, 0], [7, 2, 0], [0, 5, 0]]
    assert inputs.positions.tolist() == [9, 4, 0, 1, 2, 3, 4, 5, 4, 5, 6]
    assert inputs.input_ids.tolist() == [
        2009,
        4004,
        *(1000 + i for i in range(6)),
        3004,
        3005,
        3006,
    ]
    # slot = block_id * bs + pos % bs, by hand:
    # b pos 9 -> block 11 -> 45; d pos 4 -> block 6 -> 24;
    # a pos 0..3 -> block 7 -> 28..31, pos 4, 5 -> block 2 -> 8, 9;
    # c pos 4, 5, 6 -> block 5 -> 20, 21, 22.
    assert attn.slot_mapping.tolist() == [45, 24, 28, 29, 30, 31, 8, 9, 20, 21, 22]
    assert [s.req_id for s in inputs.sampling_states] == ["b", "d", "a"]
    assert [batch.req_ids[r] for r in inputs.sampling_rows] == ["b", "d", "a"]
    assert inputs.logits_indices.tolist() == [0, 1, 7]
    assert inputs.output_spans == {"b": (0, 1, 9), "d": (1, 1, 4), "a": (2, 6, 0), "c": (8, 3, 4)}
    for arr in (attn.query_start_loc, attn.seq_lens, attn.block_table, attn.slot_mapping):
        assert arr.dtype == np.int64


def test_build_step_inputs_selects_output_rows() -> None:
    """With select_outputs, the rows the step uses: b and d decode, a samples its last row, c
    (a chunk that does not sample) outputs all its rows for prompt logprobs, e none."""
    batch = _batch()
    scored = _new("c", 10, [0, 5], 4)
    scored.sampling_params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    so = SchedulerOutput(
        scheduled_new_reqs=[
            _new("a", 6, [7, 2], 0),
            _new("b", 10, [3, 9, 11], 9),
            scored,
            _new("d", 5, [14, 6], 4),
            _new("e", 9, [1, 4], 0),  # tokens 0..4 of 9: no sample, no outputs
        ],
        scheduled_req_ids=["a", "b", "c", "d", "e"],
        num_scheduled_tokens={"a": 6, "b": 1, "c": 3, "d": 1, "e": 5},
        num_computed_tokens={"a": 0, "b": 9, "c": 4, "d": 4, "e": 0},
    )
    batch.apply(so)
    every_row = build_step_inputs(batch, so, 4)
    inputs = build_step_inputs(batch, so, 4, select_outputs=True)

    assert [s.req_id for s in inputs.states] == ["b", "d", "a", "c", "e"]
    assert every_row.output_rows is None and every_row.attn.output_query_lens is None
    assert inputs.attn.output_query_lens.tolist() == [1, 1, 1, 3, 0]
    assert inputs.output_rows.tolist() == [0, 1, 7, 8, 9, 10]  # token rows
    # logits and the first rows of c (prompt logprobs) index the output rows
    assert every_row.logits_indices.tolist() == [0, 1, 7]
    assert inputs.logits_indices.tolist() == [0, 1, 2]
    assert inputs.output_spans["c"] == (3, 3, 4)
    assert every_row.output_spans["c"] == (8, 3, 4)


def test_build_step_inputs_pools_last_rows_only_when_the_pooler_reads_no_other() -> None:
    """Pooling requests (whole prompts) output every row, or with `pool_last_row` the last
    one of a step that ends the prompt (c: a first chunk, none); the spans say where each
    request's output rows are and whose positions they hold."""
    batch = _batch()
    reqs = [_new("a", 6, [7, 2], 0), _new("b", 3, [3], 0), _new("c", 9, [1, 4, 5], 0)]
    for r in reqs:
        r.sampling_params, r.pooling_params = None, PoolingParams()
    so = SchedulerOutput(
        scheduled_new_reqs=reqs,
        scheduled_req_ids=["a", "b", "c"],
        num_scheduled_tokens={"a": 6, "b": 3, "c": 4},
        num_computed_tokens={"a": 0, "b": 0, "c": 0},
    )
    batch.apply(so)
    every_row = build_step_inputs(batch, so, 4, select_outputs=True)
    last = build_step_inputs(batch, so, 4, select_outputs=True, pool_last_row=True)
    assert every_row.output_rows is None
    assert every_row.output_spans == {"a": (0, 6, 0), "b": (6, 3, 0), "c": (9, 4, 0)}
    assert last.output_rows.tolist() == [5, 8]
    assert last.attn.output_query_lens.tolist() == [1, 1, 0]
    assert last.output_spans == {"a": (0, 1, 5), "b": (1, 1, 2), "c": (2, 0, 4)}
    assert last.logits_indices.tolist() == []


def test_build_step_inputs_never_selects_no_rows() -> None:
    """A step of prompt chunks that neither sample nor score keeps its last row anyway, so that
    no kernel of the last layer is given an empty batch."""
    batch = _batch()
    so = SchedulerOutput(
        scheduled_new_reqs=[_new("a", 9, [1, 4, 6], 0), _new("b", 9, [2, 3, 5], 0)],
        scheduled_req_ids=["a", "b"],
        num_scheduled_tokens={"a": 5, "b": 3},
        num_computed_tokens={"a": 0, "b": 0},
    )
    batch.apply(so)
    inputs = build_step_inputs(batch, so, 4, select_outputs=True)
    assert inputs.output_rows.tolist() == [7]
    assert inputs.attn.output_query_lens.tolist() == [0, 1]
    assert inputs.logits_indices.tolist() == []


def test_build_step_inputs_feeds_the_backend() -> None:
    """The builder's metadata and a cache filled through it match the dense reference."""
    bs, heads, kv_heads = 2, 4, 2
    lengths = {"a": 5, "b": 3, "c": 4}
    tables = {"a": [4, 0, 9], "b": [7, 1], "c": [11, 3]}
    batch = _batch()
    gen = torch.Generator().manual_seed(5)
    full = {
        rid: [torch.randn(n, kv_heads, HEAD_SIZE, generator=gen) for _ in "kv"]
        for rid, n in lengths.items()
    }
    kv_cache = torch.zeros(2, 12, bs, kv_heads, HEAD_SIZE)
    backend = CPUAttentionBackend()
    # step 1: chunks of a and c (3 tokens each); step 2: the rest of a (2 tokens after a cached
    # prefix), b whole, and c's last token (a decode-shaped row reading 3 cached tokens).
    plan = [
        ({"a": 3, "c": 3}, {"a": 0, "c": 0}),
        ({"a": 2, "b": 3, "c": 1}, {"a": 3, "b": 0, "c": 3}),
    ]
    scale = HEAD_SIZE**-0.5
    for num_sched, computed in plan:
        so = SchedulerOutput(
            scheduled_new_reqs=[
                _new(rid, lengths[rid], tables[rid], 0)
                for rid in num_sched
                if rid not in batch.requests
            ],
            scheduled_req_ids=list(num_sched),
            num_scheduled_tokens=num_sched,
            num_computed_tokens=computed,
        )
        batch.apply(so)
        inputs = build_step_inputs(batch, so, bs)
        order = [s.req_id for s in inputs.states]
        new = {rid: slice(computed[rid], computed[rid] + num_sched[rid]) for rid in order}
        key = torch.cat([full[rid][0][new[rid]] for rid in order])
        value = torch.cat([full[rid][1][new[rid]] for rid in order])
        queries = {
            rid: torch.randn(num_sched[rid], heads, HEAD_SIZE, generator=gen) for rid in order
        }
        query = torch.cat([queries[rid] for rid in order])
        metadata = backend.build(inputs.attn, torch.device("cpu"))
        out = backend.forward(query, key, value, kv_cache, metadata, scale, None)
        expected = torch.cat(
            [
                reference_attention(
                    queries[rid],
                    full[rid][0][: computed[rid] + num_sched[rid]],
                    full[rid][1][: computed[rid] + num_sched[rid]],
                    scale,
                    None,
                )
                for rid in order
            ]
        )
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert order == ["c", "a", "b"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 21])
@pytest.mark.parametrize(
    ("d", "heads", "block_size"),
    [(16, 4, 4), (64, 4, 4), (128, 4, 4), (64, 14, 16), (256, 4, 32), (64, 32, 16)],
)
def test_c_decode_kernel_matches_torch_path(dtype, window, d, heads, block_size) -> None:
    """The compiled decode kernel and the PyTorch gather+SDPA path agree (both are used).

    Head size 16 takes the portable C loop; 64, 128 and 256 the AVX-512 one, and with bf16,
    at most 16 heads per kv head and blocks of 16k slots, AMX scores, where compiled in.
    """
    from pagedlm.kernels.cpu import cpu_kernels
    from pagedlm.kernels.cpu_attention import paged_decode_attention

    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("no C compiler here: only the PyTorch path runs")
    gen = torch.Generator().manual_seed(0)
    num_seqs, kv_heads, max_blocks = 5, 2, 70 // block_size + 1
    num_blocks = num_seqs * max_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    lens = torch.tensor([1, 4, 17, 40, 70])
    table = torch.randperm(num_blocks, generator=gen).view(num_seqs, max_blocks)
    query = torch.randn(num_seqs, heads, d, generator=gen).to(dtype)
    got = paged_decode_attention(kernel, query, k_cache, v_cache, table, lens, 0.3, window)
    max_len = int(lens.max())
    k = k_cache[table].flatten(1, 2)[:, :max_len].transpose(1, 2).float()
    v = v_cache[table].flatten(1, 2)[:, :max_len].transpose(1, 2).float()
    pos = torch.arange(max_len)
    mask = pos[None, :] < lens[:, None]
    if window is not None:
        mask &= pos[None, :] >= lens[:, None] - window
    want = torch.nn.functional.scaled_dot_product_attention(
        query.float().unsqueeze(2),
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=0.3,
        enable_gqa=True,
    ).squeeze(2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, atol=tol)
