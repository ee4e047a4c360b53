"""ctypes wrappers of the paged attention kernels (csrc/paged_decode.c, csrc/paged_prefill.c).

- `paged_decode_attention`: one query row per sequence, K/V read straight from the paged cache
  through the block table (no gather copy); work items (sequence, kv head, split of the
  context), split-KV merged by log-sum-exp, so one long sequence uses every core. AMX scores
  (bf16 caches) and AVX-512 softmax/values where the compiler targets them, portable C otherwise.
- `paged_prefill_attention`: every prefill chunk, tiled with an online softmax over the paged
  cache (bottom-right causal, sliding windows, GQA); AVX-512 BF16 dot products / fp32 FMAs.
- `reshape_and_cache`: the step's new keys and values into their cache slots (csrc/elementwise.c;
  torch's index_copy_ from the strided qkv rows runs at ~0.3 GB/s).

Caches are bf16 / fp32 (the model dtype) or fp8 e4m3 / e5m2 with per-tensor scales
(value = fp8 * k_scale), converted in registers.
"""

from __future__ import annotations

import ctypes

import torch

from pagedlm import envs
from pagedlm.kernels.cpu import checked, declare, is_bf16

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
declare(
    "paged_decode_attention",
    # q, k_cache, v_cache, block_table, max_blocks, seq_lens, out, num_seqs, num_heads,
    # num_kv_heads, head_size, block_size, scale, window, bf16, kv kind, k_scale, v_scale,
    # min_split, num_threads -> 0, or -1 when out of memory
    [_ptr] * 4 + [_i64, _ptr, _ptr] + [_i64] * 5 + [_f32, _i64, _int, _int, _f32, _f32, _i64, _int],
    _int,
)
# seq_lens, num_seqs, num_kv_heads, window, min_split, num_threads, splits (out)
declare("paged_decode_num_splits", [_ptr, _i64, _i64, _i64, _i64, _int, _ptr])
declare(
    "paged_prefill_attention",
    # q, q_stride, k_cache, v_cache, block_table, max_blocks, query_start_loc, seq_lens, out,
    # num_reqs, num_heads, num_kv_heads, head_size, block_size, scale, window, bf16, kv kind,
    # k_scale, v_scale, num_threads -> 0, or -1 when out of memory
    [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr]
    + [_i64] * 5
    + [_f32, _i64, _int, _int, _f32, _f32, _int],
    _int,
)

# key, value, key_stride, value_stride (bytes), k_cache, v_cache, slots, tokens, row_bytes,
# num_slots, num_threads -> number of slots out of range (then nothing is written)
declare("reshape_and_cache", [_ptr] * 2 + [_i64] * 2 + [_ptr] * 3 + [_i64] * 3 + [_int], _i64)


# The cache's element kinds as the kernels number them (KV_* in csrc/common.h).
KV_CACHE_KINDS = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float8_e4m3fn: 2,
    torch.float8_e5m2: 3,
}


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The layout every kernel reading or writing the paged caches assumes."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("caches must be [num_blocks, block_size, kv_heads, head_size], alike")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")


def _check_paged_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor
) -> int:
    """Shapes, dtypes and layouts the attention kernels read by pointer; returns the kv kind."""
    is_bf16(query)
    if query.dim() != 3 or query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        raise ValueError("query must be [tokens, heads, head_size] with contiguous heads")
    if k_cache.dtype not in KV_CACHE_KINDS or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"unsupported KV cache dtypes {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.dtype.itemsize >= 2 and k_cache.dtype != query.dtype:
        raise TypeError(f"a {k_cache.dtype} cache needs {k_cache.dtype} queries, not {query.dtype}")
    _check_cache_pair(k_cache, v_cache)
    if k_cache.shape[3] != query.shape[2]:
        raise ValueError("caches must be [num_blocks, block_size, kv_heads, head_size], alike")
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if block_table.dtype != torch.int64 or block_table.dim() != 2:
        raise TypeError("block_table must be a 2-D int64 tensor")
    return KV_CACHE_KINDS[k_cache.dtype]


def check_block_ids(
    block_table: torch.Tensor, seq_lens: torch.Tensor, k_cache: torch.Tensor
) -> None:
    """With PAGEDLM_CHECK_KERNEL_ARGS=1: every block a sequence of `seq_lens` reads through
    `block_table` is a block of the cache (the C kernels trust the ids). One pass over the
    table per call, so off by default."""
    if not envs.PAGEDLM_CHECK_KERNEL_ARGS or block_table.numel() == 0:
        return
    num_blocks, block_size = k_cache.shape[:2]
    blocks_read = (seq_lens + block_size - 1) // block_size
    if int(blocks_read.max()) > block_table.shape[1]:
        raise ValueError("seq_lens reach past the block_table's columns")
    ids = block_table[torch.arange(block_table.shape[1]) < blocks_read[:, None]]
    outside = ids[(ids < 0) | (ids >= num_blocks)]
    if outside.numel():
        raise ValueError(
            f"block_table holds block id {int(outside[0])}, outside the cache's [0, {num_blocks})"
        )


def paged_prefill_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # [tokens, num_heads, head_size], rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int64
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int64, rows of `query`
    seq_lens: torch.Tensor,  # [num_reqs] int64, tokens in the cache including these rows
    scale: float,
    sliding_window: int | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal (bottom-right aligned) attention of each request's query rows over its cached
    sequence, read through the block table with a tiled online softmax (csrc/paged_prefill.c).
    The rows' own keys must already be in the cache. Rows outside query_start_loc are left
    uninitialized in the result."""
    kind = _check_paged_inputs(query, k_cache, v_cache, block_table)
    block_table = block_table.contiguous()
    num_reqs = block_table.shape[0]
    for name, t, n in (
        ("query_start_loc", query_start_loc, num_reqs + 1),
        ("seq_lens", seq_lens, num_reqs),
    ):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (n,):
            raise ValueError(f"{name} must be a contiguous int64 tensor of {n} entries")
    if num_reqs and int(query_start_loc[-1]) > query.shape[0]:
        raise ValueError("query_start_loc reaches past the query rows")
    check_block_ids(block_table, seq_lens, k_cache)
    out = torch.empty(query.shape, dtype=query.dtype)
    _, block_size, num_kv_heads, head_size = k_cache.shape
    rc = lib.paged_prefill_attention(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.shape[1],
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_reqs,
        query.shape[1],
        num_kv_heads,
        head_size,
        block_size,
        scale,
        sliding_window or 0,
        is_bf16(query),
        kind,
        k_scale,
        v_scale,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("paged_prefill_attention could not allocate its scratch memory")
    return out


def paged_decode_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    min_split: int = 0,
) -> tuple:
    """The checked arguments of the C `paged_decode_attention` (query and block_table
    contiguous; out like query)."""
    kind = _check_paged_inputs(query, k_cache, v_cache, block_table)
    fn = "paged_decode_attention"
    num_seqs, num_heads, head_size = query.shape
    if seq_lens.dtype != torch.int64 or not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be a contiguous int64 tensor")
    if seq_lens.shape != (num_seqs,) or block_table.shape[0] != num_seqs:
        raise ValueError("one seq_lens entry and one block_table row per query row")
    check_block_ids(block_table, seq_lens, k_cache)
    _, block_size, num_kv_heads, _ = k_cache.shape
    return (
        checked(fn, "query", query, query.dtype),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        checked(fn, "block_table", block_table, torch.int64),
        block_table.shape[1],
        seq_lens.data_ptr(),
        checked(fn, "out", out, query.dtype, tuple(query.shape)),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        scale,
        sliding_window or 0,
        is_bf16(query),
        kind,
        k_scale,
        v_scale,
        min_split,
        torch.get_num_threads(),
    )


def paged_decode_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64
    scale: float,
    sliding_window: int | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    min_split: int = 0,
) -> torch.Tensor:
    """One query row per sequence over its cached context (csrc/paged_decode.c); long contexts
    are split over the threads and merged (split-KV). min_split: fewest keys per split (0:
    the kernel's default)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    args = paged_decode_args(
        query,
        k_cache,
        v_cache,
        block_table.contiguous(),
        seq_lens,
        out,
        scale,
        sliding_window,
        k_scale,
        v_scale,
        min_split,
    )
    if lib.paged_decode_attention(*args) != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch memory")
    return out


def paged_decode_num_splits(
    lib: ctypes.CDLL,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    sliding_window: int | None,
    num_threads: int,
    min_split: int = 256,
) -> list[int]:
    """How many pieces the decode kernel cuts each sequence's context into."""
    seq_lens = seq_lens.to(torch.int64).contiguous()
    splits = torch.empty_like(seq_lens)
    lib.paged_decode_num_splits(
        seq_lens.data_ptr(),
        seq_lens.shape[0],
        num_kv_heads,
        sliding_window or 0,
        min_split,
        num_threads,
        splits.data_ptr(),
    )
    return splits.tolist()


def reshape_and_cache_args(
    key: torch.Tensor,  # [tokens, num_kv_heads, head_size], rows may be strided
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64, flat slot (block * block_size + offset)
) -> tuple:
    """The checked arguments of the C `reshape_and_cache` (which checks the slots' range)."""
    _check_cache_pair(k_cache, v_cache)
    row = tuple(k_cache.shape[2:])
    tokens = slot_mapping.shape[0]
    for name, t in (("key", key), ("value", value)):
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} is {t.dtype}, the cache {k_cache.dtype}")
        if t.dim() != 3 or tuple(t.shape[1:]) != row or t.shape[0] < tokens:
            raise ValueError(f"{name} must be [>= {tokens}, {row[0]}, {row[1]}]")
        if t.stride(2) != 1 or t.stride(1) != row[1]:
            raise ValueError(f"{name} must have contiguous heads")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous int64 tensor")
    size = k_cache.element_size()
    return (
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0) * size,
        value.stride(0) * size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        tokens,
        row[0] * row[1] * size,
        k_cache.shape[0] * k_cache.shape[1],
        torch.get_num_threads(),
    )


def reshape_and_cache(
    lib: ctypes.CDLL,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key[i] / value[i] to cache slot slot_mapping[i] (an fp8 cache: quantized rows)."""
    args = reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping)
    bad = lib.reshape_and_cache(*args)
    if bad:
        raise IndexError(f"reshape_and_cache: {bad} slots outside the cache of {args[9]} slots")
