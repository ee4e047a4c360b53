"""The tiled C prefill kernel against a dense fp64 reference and the PyTorch SDPA path, at
contexts spanning many blocks, several chunks per sequence, GQA, sliding windows and partial
blocks, in fp32 and bf16, for the portable, AVX-512 fp32, AVX-512 BF16 and AVX2 inner paths (each
machine runs the ones its CPU has)."""

from __future__ import annotations

import pytest
import torch

from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.kernels.cpu_attention import paged_prefill_attention

lib = cpu_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: PyTorch paths only")


def make_paged(
    specs: list[tuple[int, int]],  # (cached tokens, new query rows) per request
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    rising: float = 0.0,
):
    """A cache holding every request's whole sequence in shuffled blocks, and its queries.
    With `rising`, scores grow by about that many nats per key position (keys and queries
    share a direction), so that every row's max keeps moving along the context."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in specs]
    nblocks = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(nblocks) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(specs), max(nblocks), dtype=torch.long)
    at = 0
    for r, nb in enumerate(nblocks):
        table[r, :nb] = perm[at : at + nb]
        at += nb
    # finite garbage everywhere the sequences do not write (other requests' stale rows)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    direction = torch.full((head_size,), head_size**-0.5)  # unit; q . k scaled by d^-0.5
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        blocks, offsets = table[r, pos // block_size], pos % block_size
        cache[0, blocks, offsets] += (rising * head_size**0.5 * pos)[:, None, None] * direction
    cache = cache.to(dtype)
    keys, values = [], []
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        blocks, offsets = table[r, pos // block_size], pos % block_size
        keys.append(cache[0, blocks, offsets].float())
        values.append(cache[1, blocks, offsets].float())
    queries = [
        (0.3 * torch.randn(n, num_heads, head_size, generator=gen) + direction).to(dtype)
        if rising
        else torch.randn(n, num_heads, head_size, generator=gen).to(dtype)
        for _, n in specs
    ]
    qsl = torch.tensor([0] + [n for _, n in specs]).cumsum(0)
    return cache, table, torch.tensor(seq_lens), qsl, queries, keys, values


def dense_reference(q, k, v, scale, window):
    """fp64 softmax attention of q [n, H, d] (the last n positions) over k, v [S, Hkv, d]."""
    n, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    q_pos = torch.arange(seq_len - n, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def sdpa_path(q, cache, table_row, seq_len, scale, window):
    """The PyTorch backend's way: gather the blocks, SDPA with a bottom-right causal mask."""
    from pagedlm.attention.cpu_attn import causal_mask

    block_size = cache.shape[2]
    nb = (seq_len + block_size - 1) // block_size
    k = cache[0][table_row[:nb]].flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
    v = cache[1][table_row[:nb]].flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
    mask = causal_mask(q.shape[0], seq_len, window, q.device)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.squeeze(0).transpose(0, 1)


def check(specs, heads, kv_heads, d, block_size, dtype, window, seed=0, strided=False, rising=0.0):
    cache, table, seq_lens, qsl, queries, keys, values = make_paged(
        specs, heads, kv_heads, d, block_size, dtype, seed, rising
    )
    scale = d**-0.5
    query = torch.cat(queries)
    if strided:  # rows of a fused qkv projection: q is a strided view
        wide = torch.randn(query.shape[0], heads * d + 40).to(dtype)
        wide[:, : heads * d] = query.flatten(1)
        query = wide[:, : heads * d].view(-1, heads, d)
        assert not query.is_contiguous()
    got = paged_prefill_attention(
        lib, query, cache[0], cache[1], table, qsl, seq_lens, scale, window
    )
    assert got.dtype == dtype and got.shape == query.shape
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for r, q in enumerate(queries):
        rows = got[int(qsl[r]) : int(qsl[r + 1])].float()
        want = dense_reference(q.float(), keys[r], values[r], scale, window).float()
        torch.testing.assert_close(rows, want, atol=tol, rtol=tol)
        twin = sdpa_path(q, cache, table[r], int(seq_lens[r]), scale, window).float()
        torch.testing.assert_close(rows, twin, atol=tol, rtol=tol)


# (cached, new): a fresh prompt, chunks after cached prefixes that end mid-block, a 1-row chunk
LONG = [(0, 70), (300, 64), (517, 37), (129, 1), (64, 100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [8, 48, 64, 128, 256])  # 8: portable; 48: portable or AVX2
def test_long_contexts_head_sizes(dtype, d) -> None:
    check(LONG, 4, 2, d, 16, dtype, None, seed=d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(14, 2), (8, 8), (4, 1), (16, 2)])
def test_gqa_groups(dtype, heads, kv_heads) -> None:
    check([(0, 40), (200, 33), (95, 2)], heads, kv_heads, 64, 16, dtype, None, seed=heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 33, 256, 4096])
@pytest.mark.parametrize("d", [16, 64])
def test_sliding_windows(dtype, window, d) -> None:
    check(LONG, 4, 2, d, 16, dtype, window, seed=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 3, 5, 32, 128])
def test_block_sizes(dtype, block_size) -> None:
    check([(0, 50), (77, 23), (260, 9)], 4, 2, 64, block_size, dtype, 40, seed=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_items_across_key_tiles(dtype) -> None:
    """Work items of 73 query tokens (group 7) that cross a 256-key tile: on the diagonal tile
    the vector paths stop each row block at the keys its rows see, and blocks before the tile
    see none of it."""
    check([(0, 600), (190, 150)], 14, 2, 64, 16, dtype, None, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_query_rows(dtype) -> None:
    check([(10, 30), (0, 17)], 8, 2, 64, 16, dtype, None, strided=True)


# fp32 stops at 0.08: scores of ~200 nats carry more fp32 rounding than its tolerance
@pytest.mark.parametrize(
    ("dtype", "rising"),
    [(torch.float32, 0.01), (torch.float32, 0.08)]
    + [(torch.bfloat16, rising) for rising in (0.01, 0.03, 0.3)],
)
def test_scores_rising_along_the_context(dtype, rising) -> None:
    """Later key tiles keep raising each row's max, slowly (within the AVX-512 paths' lazy-max
    slack: probabilities above 1 and, in bf16, tiles redone when their sums pass it) or fast
    (every tile rescales the accumulators; at 0.3, bf16 probabilities overflow unless redone)."""
    check([(0, 300), (600, 40)], 8, 2, 64, 16, dtype, None, seed=7, rising=rising)


def test_many_chunks_of_one_sequence_compose() -> None:
    """Running a 1000-token prompt as chunks of 64 gives the rows of the whole-prompt call."""
    cache, table, seq_lens, _, _, _, _ = make_paged([(0, 1000)], 14, 2, 64, 16, torch.bfloat16)
    q = torch.randn(1000, 14, 64).bfloat16()
    whole = paged_prefill_attention(
        lib, q, cache[0], cache[1], table, torch.tensor([0, 1000]), seq_lens, 0.125, None
    )
    for start in range(0, 1000, 64):
        end = min(1000, start + 64)
        part = paged_prefill_attention(
            lib,
            q[start:end],
            cache[0],
            cache[1],
            table,
            torch.tensor([0, end - start]),
            torch.tensor([end]),
            0.125,
            None,
        )
        torch.testing.assert_close(part, whole[start:end], atol=0, rtol=0)


def test_rejects_bad_inputs() -> None:
    cache, table, seq_lens, qsl, queries, _, _ = make_paged([(3, 4)], 4, 2, 64, 16, torch.float32)
    q = torch.cat(queries)
    with pytest.raises(TypeError):
        paged_prefill_attention(
            lib, q.bfloat16(), cache[0], cache[1], table, qsl, seq_lens, 1.0, None
        )
    with pytest.raises(ValueError):
        paged_prefill_attention(lib, q, cache[0], cache[1], table, qsl.int(), seq_lens, 1.0, None)
    with pytest.raises(ValueError):
        paged_prefill_attention(lib, q[:2], cache[0], cache[1], table, qsl, seq_lens, 1.0, None)
    with pytest.raises(ValueError):
        paged_prefill_attention(lib, q[:, :3], cache[0], cache[1], table, qsl, seq_lens, 1.0, None)
