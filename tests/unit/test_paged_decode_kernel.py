"""Split-KV decode: the C decode kernel with contexts cut into pieces for several threads and
merged by log-sum-exp, against the dense fp64 reference and the PyTorch path; the split policy."""

from __future__ import annotations

import pytest
import torch

from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.kernels.cpu_attention import paged_decode_attention, paged_decode_num_splits
from tests.unit.test_paged_prefill_kernel import dense_reference, make_paged, sdpa_path

lib = cpu_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: PyTorch paths only")

LENS = [1, 4, 17, 300, 1000, 2049]


def check_decode(
    lens, heads, kv_heads, d, block_size, dtype, window, min_split, seed=0, rising=0.0
):
    specs = [(n - 1, 1) for n in lens]
    cache, table, seq_lens, _, queries, keys, values = make_paged(
        specs, heads, kv_heads, d, block_size, dtype, seed, rising
    )
    query = torch.cat(queries)
    scale = d**-0.5
    got = paged_decode_attention(
        lib, query, cache[0], cache[1], table, seq_lens, scale, window, min_split=min_split
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for r, q in enumerate(queries):
        want = dense_reference(q.float(), keys[r], values[r], scale, window).float()
        torch.testing.assert_close(got[r : r + 1].float(), want, atol=tol, rtol=tol)
        twin = sdpa_path(q, cache, table[r], int(seq_lens[r]), scale, window).float()
        torch.testing.assert_close(got[r : r + 1].float(), twin, atol=tol, rtol=tol)
    return seq_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 128, 256])  # 16: portable; others AVX-512
@pytest.mark.parametrize("min_split", [1, 7, 64, 0])  # 0: the default (256)
def test_split_decode_matches_reference(dtype, d, min_split) -> None:
    seq_lens = check_decode(LENS, 8, 2, d, 16, dtype, None, min_split, seed=d)
    if min_split:
        splits = paged_decode_num_splits(lib, seq_lens, 2, None, torch.get_num_threads(), min_split)
        assert max(splits) > 1  # the merge really ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rising", [0.02, -0.02])
def test_running_max_across_pieces(dtype, rising) -> None:
    """One unsplit item walks its context in pieces (flash-style, DECODE_PIECE = 256 keys):
    scores that rise along the context move the max in every piece (each rescales what came
    before), falling ones keep the first piece's; both against the reference."""
    check_decode([1500, 700], 8, 2, 64, 16, dtype, None, 100000, seed=3, rising=rising)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 300, 5000])
def test_split_decode_sliding_window(dtype, window) -> None:
    check_decode(LENS, 4, 2, 64, 16, dtype, window, 3, seed=window)


@pytest.mark.parametrize(("heads", "kv_heads"), [(14, 2), (4, 4), (32, 2), (4, 1), (32, 1)])
@pytest.mark.parametrize("block_size", [3, 16, 32])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_split_decode_gqa_and_blocks(heads, kv_heads, block_size, d) -> None:
    """Groups of 1 to 32 query heads per kv head at every AVX-512 head size: the weighted
    values keep up to 24 sums in registers, all heads over a part of the columns where they
    do not fit at full width (group x head size 7 x 64 .. 32 x 256), in several passes of
    heads past 24."""
    check_decode([5, 333, 1500], heads, kv_heads, d, block_size, torch.bfloat16, None, 50)


def test_one_long_sequence_feeds_every_thread() -> None:
    one = torch.tensor([16000])
    for threads in (1, 2, 8, 32):
        splits = paged_decode_num_splits(lib, one, 2, None, threads)
        assert 2 * splits[0] >= min(threads, 16000 // 256)  # at least one item per thread
        assert splits[0] <= 64
    # a big batch of short sequences is not split; a long one among them is
    batch = torch.tensor([300] * 64 + [20000])
    splits = paged_decode_num_splits(lib, batch, 2, None, 2)
    assert splits[:64] == [1] * 64 and splits[64] > 1
    # a sliding window bounds what a sequence attends, so it is not split further
    assert paged_decode_num_splits(lib, one, 2, 128, 8) == [1]


def test_decode_rejects_bad_inputs() -> None:
    cache, table, seq_lens, _, queries, _, _ = make_paged([(3, 1)], 4, 2, 64, 16, torch.float32)
    q = torch.cat(queries)
    with pytest.raises(ValueError):
        paged_decode_attention(lib, q, cache[0], cache[1], table, seq_lens.int(), 1.0, None)
    with pytest.raises(TypeError):
        paged_decode_attention(lib, q.bfloat16(), cache[0], cache[1], table, seq_lens, 1.0, None)


def test_debug_mode_checks_block_ids(monkeypatch) -> None:
    """PAGEDLM_CHECK_KERNEL_ARGS=1: a block id outside the cache raises instead of being read
    (entries past a sequence's blocks are not read, so they may hold anything)."""
    cache, table, seq_lens, _, queries, _, _ = make_paged(
        [(3, 1), (40, 1)], 4, 2, 64, 16, torch.float32
    )
    q = torch.cat(queries)
    table[0, 1:] = -7  # request 0 reads one block: the rest is padding
    monkeypatch.setenv("PAGEDLM_CHECK_KERNEL_ARGS", "1")
    paged_decode_attention(lib, q, cache[0], cache[1], table, seq_lens, 1.0, None)
    table[1, 2] = cache.shape[1]  # one past the last block, read by request 1
    with pytest.raises(ValueError, match="outside the cache"):
        paged_decode_attention(lib, q, cache[0], cache[1], table, seq_lens, 1.0, None)
    monkeypatch.delenv("PAGEDLM_CHECK_KERNEL_ARGS")
    table[1, 2] = 0
    paged_decode_attention(lib, q, cache[0], cache[1], table, seq_lens, 1.0, None)
