"""Small helpers with no pagedlm dependencies, shared by every layer."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers: the blocks `a` tokens need at `b` per block."""
    return -(-a // b)


def release_mapped_pages(address: int, nbytes: int) -> None:
    """Drop this process's resident pages of [address, address + nbytes) in a read-only file
    mapping (madvise MADV_DONTNEED; they come back from the page cache if read again).

    Only for memory that maps a file shared (np.memmap mode "r"): on anonymous memory it
    would zero the data. A no-op where libc has no madvise.
    """
    madvise = _madvise()
    if nbytes <= 0 or madvise is None:
        return
    page = mmap.PAGESIZE
    start = address // page * page
    madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start), _MADV_DONTNEED)


_MADV_DONTNEED = 4
_HUGE_PAGE = 2 << 20  # x86-64 and most arm64 kernels' transparent huge page


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, parts: int = 1) -> torch.Tensor:
    """A zero tensor in host memory whose pages the OS maps only when first written
    (anonymous mmap). Each of its `parts` equal ranges (a KV cache's K and V) keeps 4 KiB
    pages for its first huge page and is advised into transparent huge pages past it, where
    the kernel allows (THP "madvise" or "always").

    Huge pages, because data streamed from all over a large range misses the TLB on nearly
    every 4 KiB page: decode attention over 24 layers of 8 x 4096 tokens went 1.84 -> 1.57 ms
    a layer; a 151936 x 896 Q8_0 GEMV, 5-10% faster. The first 2 MiB in 4 KiB pages, because a
    paged KV cache hands out its first blocks first: a short context maps only what it writes
    instead of a 2 MiB page per range of every layer (96 MB on the default model)."""
    import numpy as np
    import torch

    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        part = nbytes // parts
        for start in range(0, part * parts, part):
            begin = -(-(start + _HUGE_PAGE) // mmap.PAGESIZE) * mmap.PAGESIZE
            if begin >= start + part:
                continue
            try:
                buf.madvise(mmap.MADV_HUGEPAGE, begin, start + part - begin)
            except OSError:  # a kernel without THP: 4 KiB pages
                break
    # the tensor keeps `buf` alive through the buffer protocol
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def trim_malloc_heap() -> None:
    """Give the heap pages freed so far back to the system: loading frees large temporaries
    (tokenizer parsing, weight repacking) that the allocator would otherwise keep resident.
    tcmalloc's ReleaseFreeMemory where it is preloaded (gperftools' C API), else glibc's
    malloc_trim; a no-op under another allocator or libc."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
    elif (trim := getattr(process, "malloc_trim", None)) is not None:
        trim(ctypes.c_size_t(0))


@functools.cache
def _madvise() -> Any:
    """libc's madvise (looked up once), or None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """(address, nbytes) of this process's mappings of the file `path` (Linux; [] elsewhere)."""
    real = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == real:
                    start, end = (int(a, 16) for a in fields[0].split("-"))
                    ranges.append((start, end - start))
    except OSError:
        return []
    return ranges
