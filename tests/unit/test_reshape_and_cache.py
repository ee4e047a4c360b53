"""The C paged cache write against torch's index_copy_: strided key/value rows (views of a
fused qkv output), every cache dtype including fp8, and slots out of range refused whole."""

from __future__ import annotations

import pytest
import torch

from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.kernels.cpu_attention import reshape_and_cache

lib = cpu_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: PyTorch paths only")


def qkv_rows(tokens: int, kv_heads: int, head_size: int, dtype: torch.dtype):
    """key and value as strided views into a [tokens, q | k | v] projection output."""
    q_size, kv_size = 4 * kv_heads * head_size, kv_heads * head_size
    qkv = torch.randn(tokens, q_size + 2 * kv_size).to(dtype)
    key = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_size)
    value = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_size)
    return key, value


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_matches_index_copy(dtype, tokens) -> None:
    kv_heads, head_size, num_blocks, block_size = 2, 64, 40, 16
    key, value = qkv_rows(tokens, kv_heads, head_size, torch.float32)
    key, value = key.to(dtype), value.to(dtype)  # fp8: contiguous quantized rows
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    shape = (num_blocks, block_size, kv_heads, head_size)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for want, new in ((want_k, key), (want_v, value)):
        flat = want.view(-1, kv_heads, head_size).view(torch.uint8)
        flat.index_copy_(0, slots, new.view(torch.uint8))
    reshape_and_cache(lib, key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))


def test_strided_rows_and_extra_rows() -> None:
    """Rows of the fused qkv output (stride > row) and inputs longer than slot_mapping."""
    key, value = qkv_rows(50, 2, 64, torch.bfloat16)
    assert not key.is_contiguous()
    k_cache = torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(100, 140)  # the first 40 rows only
    reshape_and_cache(lib, key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 64)[100:140], key[:40])
    assert torch.equal(v_cache.view(-1, 2, 64)[100:140], value[:40])
    assert not k_cache.view(-1, 2, 64)[140:].any() and not k_cache.view(-1, 2, 64)[:100].any()


@pytest.mark.parametrize("bad_slot", [-1, 128])
def test_slots_out_of_range_write_nothing(bad_slot) -> None:
    key, value = qkv_rows(3, 2, 64, torch.float32)
    k_cache = torch.zeros(8, 16, 2, 64)
    v_cache = torch.zeros_like(k_cache)
    with pytest.raises(IndexError, match="1 slots outside"):
        reshape_and_cache(lib, key, value, k_cache, v_cache, torch.tensor([5, bad_slot, 7]))
    assert not k_cache.any() and not v_cache.any()


def test_refuses_what_it_would_misread() -> None:
    key, value = qkv_rows(3, 2, 64, torch.float32)
    k_cache = torch.zeros(8, 16, 2, 64)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="key is torch.bfloat16"):
        reshape_and_cache(lib, key.bfloat16(), value, k_cache, k_cache.clone(), slots)
    gapped = torch.randn(3, 2, 128)[:, :, :64]  # heads 128 elements apart
    with pytest.raises(ValueError, match="contiguous heads"):
        reshape_and_cache(lib, gapped, value, k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match="int64"):
        reshape_and_cache(lib, key, value, k_cache, k_cache.clone(), slots.int())
    with pytest.raises(ValueError, match="must be \\[>= 4"):
        reshape_and_cache(lib, key, value, k_cache, k_cache.clone(), torch.arange(4))
