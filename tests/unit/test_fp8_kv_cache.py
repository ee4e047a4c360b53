"""fp8 KV caches: the C kernels read e4m3 / e5m2 with per-tensor scales exactly as the PyTorch
path dequantizes them; the backend writes saturated values; kv_cache_dtype resolves as vLLM's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlm.attention.backend import CommonAttentionMetadata
from pagedlm.attention.cpu_attn import CPUAttentionBackend
from pagedlm.attention.kv_cache_dtype import (
    calculate_kv_scales,
    dequantize_kv,
    kv_cache_torch_dtype,
    quantize_kv,
)
from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.kernels.cpu_attention import paged_decode_attention, paged_prefill_attention
from tests.unit.test_paged_prefill_kernel import dense_reference, make_paged

lib = cpu_kernels()
needs_kernels = pytest.mark.skipif(lib is None, reason="no C compiler: PyTorch paths only")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_kv_cache_dtype_names() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("int8", torch.bfloat16)


def test_engine_args_accept_fp8_and_reject_unknown() -> None:
    from pagedlm.engine.arg_utils import EngineArgs

    assert EngineArgs(kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp4")


def test_calculate_kv_scales_from_batch_maxima() -> None:
    k = torch.tensor([[1.0, -400.0], [3.0, 2.0]]).bfloat16()
    v = torch.tensor([0.5, -0.25, 0.125])
    assert calculate_kv_scales(k, v) == (2.0, 0.005)
    assert calculate_kv_scales(torch.zeros(3), torch.zeros(3)) == (1.0, 1.0)


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_and_round_trips(dtype) -> None:
    x = torch.tensor([1e6, -1e6, 0.0, 1.5, -3.0])
    q = quantize_kv(x, 2.0, dtype)
    limit = torch.finfo(dtype).max
    assert q.float().tolist() == [limit, -limit, 0.0, 0.75, -1.5]
    assert dequantize_kv(q, 2.0, torch.float32).tolist() == [2 * limit, -2 * limit, 0, 1.5, -3.0]


def _fp8_cache(specs, heads, kv_heads, d, block_size, dtype, fp8, k_scale, v_scale, seed):
    cache, table, seq_lens, qsl, queries, _, _ = make_paged(
        specs, heads, kv_heads, d, block_size, torch.float32, seed
    )
    cache = cache * 3  # values past e4m3's finest steps
    stored = torch.stack([quantize_kv(cache[0], k_scale, fp8), quantize_kv(cache[1], v_scale, fp8)])
    keys, values = [], []
    for r, s in enumerate(seq_lens.tolist()):
        pos = torch.arange(s)
        blocks, offsets = table[r, pos // block_size], pos % block_size
        keys.append(dequantize_kv(stored[0, blocks, offsets], k_scale, torch.float32))
        values.append(dequantize_kv(stored[1, blocks, offsets], v_scale, torch.float32))
    queries = [q.to(dtype) for q in queries]
    return stored, table, seq_lens, qsl, queries, keys, values


@needs_kernels
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.5, 3.0)])
def test_kernels_read_fp8_caches(fp8, dtype, d, k_scale, v_scale) -> None:
    specs = [(0, 40), (300, 37), (90, 1)]
    stored, table, seq_lens, qsl, queries, keys, values = _fp8_cache(
        specs, 8, 2, d, 16, dtype, fp8, k_scale, v_scale, seed=d
    )
    scale = d**-0.5
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    got = paged_prefill_attention(
        lib,
        torch.cat(queries),
        stored[0],
        stored[1],
        table,
        qsl,
        seq_lens,
        scale,
        50,
        k_scale,
        v_scale,
    )
    for r, q in enumerate(queries):
        want = dense_reference(q.float(), keys[r], values[r], scale, 50).float()
        torch.testing.assert_close(
            got[int(qsl[r]) : int(qsl[r + 1])].float(), want, atol=tol, rtol=tol
        )
    last = torch.stack([q[-1] for q in queries])
    got = paged_decode_attention(
        lib,
        last,
        stored[0],
        stored[1],
        table,
        seq_lens,
        scale,
        None,
        k_scale,
        v_scale,
        min_split=16,
    )
    for r, q in enumerate(queries):
        want = dense_reference(q[-1:].float(), keys[r], values[r], scale, None).float()
        torch.testing.assert_close(got[r : r + 1].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", FP8)
def test_backend_paths_agree_on_fp8_cache(fp8) -> None:
    """One mixed step (decodes, a fresh prefill, a chunk after a prefix) through the PyTorch
    path and the C kernels: the same fp8 bytes land in the cache and the outputs agree."""
    heads, kv_heads, d, bs = 4, 2, 64, 16
    specs = [(40, 1), (0, 1), (0, 30), (50, 20)]  # (cached, new)
    gen = torch.Generator().manual_seed(1)
    seq_lens = [c + n for c, n in specs]
    nblocks = [(s + bs - 1) // bs for s in seq_lens]
    table = np.zeros((len(specs), max(nblocks)), np.int64)
    perm = torch.randperm(sum(nblocks), generator=gen).tolist()
    at = 0
    for r, nb in enumerate(nblocks):
        table[r, :nb] = perm[at : at + nb]
        at += nb
    slots = [
        table[r, p // bs] * bs + p % bs for r, (c, n) in enumerate(specs) for p in range(c, c + n)
    ]
    base = quantize_kv(torch.randn(2, sum(nblocks), bs, kv_heads, d, generator=gen), 0.5, fp8)
    common = CommonAttentionMetadata(
        query_start_loc=np.concatenate([[0], np.cumsum([n for _, n in specs])]).astype(np.int64),
        seq_lens=np.array(seq_lens, np.int64),
        block_table=table,
        slot_mapping=np.array(slots, np.int64),
        num_decodes=2,
    )
    t = sum(n for _, n in specs)
    q = torch.randn(t, heads, d, generator=gen)
    k = torch.randn(t, kv_heads, d, generator=gen)
    v = torch.randn(t, kv_heads, d, generator=gen)
    outs, caches = [], []
    for use_c in (False, True):
        if use_c and lib is None:
            pytest.skip("no C compiler")
        cache = base.clone()
        backend = CPUAttentionBackend(use_c_kernel=use_c)
        meta = backend.build(common, torch.device("cpu"))
        outs.append(backend.forward(q, k, v, cache, meta, d**-0.5, None, 0.5, 2.0))
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
