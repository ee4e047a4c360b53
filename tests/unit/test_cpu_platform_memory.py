"""Lazily mapped host zero tensors (`Platform.zeros_lazy`, every paged KV cache on the CPU):
zero, writable, kept alive by the tensor, and mapped only where written (a 1 GiB cache costs
no 1 GiB up front)."""

from __future__ import annotations

import gc

import psutil
import torch

from pagedlm.platforms.cpu import CpuPlatform


def test_zero_writable_and_owned_by_the_tensor() -> None:
    t = CpuPlatform().zeros_lazy((2, 8, 16, 2, 64), torch.bfloat16)
    assert t.shape == (2, 8, 16, 2, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    gc.collect()  # nothing but the tensor refers to the mapping
    t[1, 3] = 1.5
    assert t.float().sum().item() == 1.5 * 16 * 2 * 64
    assert CpuPlatform().zeros_lazy((0, 4), torch.float32).shape == (0, 4)


def test_pages_are_mapped_only_when_written() -> None:
    rss = psutil.Process().memory_info().rss
    t = CpuPlatform().zeros_lazy((1 << 30,), torch.uint8)
    assert psutil.Process().memory_info().rss - rss < 64 << 20
    t[: 8 << 20] = 1  # the first 8 MiB: at most a few huge pages more
    assert psutil.Process().memory_info().rss - rss < 128 << 20
    assert int(t[: 8 << 20].sum()) == 8 << 20 and not t[8 << 20 :].any()
