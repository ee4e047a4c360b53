"""`utils.trim_malloc_heap`: the heap that startup freed goes back to the system, under glibc
and under a preloaded tcmalloc (the benchmarks' allocator), whose free lists glibc's
malloc_trim cannot reach."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# 300 MB in 64 kB blocks, freed but the last: both allocators keep them until asked
_SCRIPT = """
import ctypes, psutil
from pagedlm.utils import trim_malloc_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(64 << 10) for _ in range(4800)]
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:  # the last stays: the heap cannot simply shrink from its top
    libc.free(b)
before = psutil.Process().memory_info().rss
trim_malloc_heap()
print((before - psutil.Process().memory_info().rss) >> 20)
"""

_TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc"])
def test_freed_heap_goes_back_to_the_system(allocator: str) -> None:
    env = dict(os.environ)
    if allocator == "tcmalloc":
        if not Path(_TCMALLOC).is_file():
            pytest.skip("no tcmalloc here (Debian: libtcmalloc-minimal4)")
        env["LD_PRELOAD"] = _TCMALLOC
    elif not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim")
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[-1]) > 200  # MB returned, of the 300 freed
