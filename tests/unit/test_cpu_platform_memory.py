"""Lazily mapped host zero tensors (`Platform.zeros_lazy`, every paged KV cache on the CPU):
zero, writable, kept alive by the tensor, and mapped only where written (a 1 GiB cache costs
no 1 GiB up front); each of its `parts` ranges (K and V) keeps 4 KiB pages for its
first 2 MiB (a short context maps only what it writes) and huge pages past it; packed
weights lie in huge pages."""

from __future__ import annotations

import gc
from pathlib import Path

import psutil
import pytest
import torch

from pagedlm.platforms.cpu import CpuPlatform

MiB = 1 << 20


def mapping_kib(t: torch.Tensor) -> dict[str, int]:
    """The smaps counters (kB) summed over the mappings that hold `t`'s bytes."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    totals: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < hi and end > lo
        elif inside and head in ("Rss:", "AnonHugePages:"):
            totals[head[:-1]] = totals.get(head[:-1], 0) + int(line.split()[1])
    return totals


def skip_without_huge_pages() -> None:
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not enabled.is_file() or "[never]" in enabled.read_text():
        pytest.skip("transparent huge pages are off on this kernel")


def test_zero_writable_and_owned_by_the_tensor() -> None:
    t = CpuPlatform().zeros_lazy((2, 8, 16, 2, 64), torch.bfloat16)
    assert t.shape == (2, 8, 16, 2, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    gc.collect()  # nothing but the tensor refers to the mapping
    t[1, 3] = 1.5
    assert t.float().sum().item() == 1.5 * 16 * 2 * 64
    assert CpuPlatform().zeros_lazy((0, 4), torch.float32).shape == (0, 4)
    odd = CpuPlatform().zeros_lazy((2, 3 * MiB + 5), torch.uint8, parts=2)  # not page-aligned
    odd[1, -1] = 7
    assert int(odd.sum()) == 7


def test_pages_are_mapped_only_when_written() -> None:
    rss = psutil.Process().memory_info().rss
    t = CpuPlatform().zeros_lazy((1 << 30,), torch.uint8)
    assert psutil.Process().memory_info().rss - rss < 64 * MiB
    t[: 8 * MiB] = 1  # the first 8 MiB: at most a few huge pages more
    assert psutil.Process().memory_info().rss - rss < 128 * MiB
    assert int(t[: 8 * MiB].sum()) == 8 * MiB and not t[8 * MiB :].any()


def test_a_short_context_maps_4k_pages_and_a_long_one_huge_pages() -> None:
    kv = CpuPlatform().zeros_lazy((2, 64 * MiB), torch.uint8, parts=2)  # one layer's K, V
    kv[:, : 64 << 10] = 1  # 64 KiB of each: what a short context writes
    assert mapping_kib(kv)["Rss"] < 1024  # no 2 MiB page per slice
    assert mapping_kib(kv).get("AnonHugePages", 0) == 0
    skip_without_huge_pages()
    kv[:, : 32 * MiB] = 1
    assert mapping_kib(kv)["AnonHugePages"] > 0


def test_packed_weights_lie_in_huge_pages() -> None:
    """A decode step streams every packed weight: in 4 KiB pages it misses the TLB."""
    from pagedlm.kernels.gguf_pack import pack_q8

    skip_without_huge_pages()
    q = torch.randint(-127, 128, (8192, 1024), dtype=torch.int8)
    packed = pack_q8(q, torch.rand(8192))
    assert mapping_kib(packed.qs)["AnonHugePages"] >= 4096  # of its 8 MiB
