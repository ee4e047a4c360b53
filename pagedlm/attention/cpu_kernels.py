"""A small C kernel for paged decode attention on the CPU, compiled once with the system gcc.

It reads K/V straight from the paged cache through the block table (no gather copy) and
parallelizes over (sequence, kv head) with OpenMP. When no compiler is available, or
PAGEDLM_DISABLE_C_KERNELS=1, `paged_decode_kernel()` returns None and the pure-PyTorch path is
used; both are checked against the same dense reference in the tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast"]


def _build() -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    from pagedlm.model_loader.catalog import cache_dir

    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_decode-{tag}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("C kernel build failed, using PyTorch attention: %s", result.stderr)
            return None
        os.replace(out, target)
    return target


@lru_cache(maxsize=1)
def paged_decode_kernel():
    """The compiled `paged_decode_attention` function, or None."""
    if os.environ.get("PAGEDLM_DISABLE_C_KERNELS") == "1":
        return None
    try:
        path = _build()
        if path is None:
            return None
        fn = ctypes.CDLL(str(path)).paged_decode_attention
    except OSError as e:
        logger.warning("C kernel unavailable, using PyTorch attention: %s", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
        i64,
        ctypes.c_int,
        ctypes.c_int,
    ]
    fn.restype = None
    return fn


def paged_decode_attention(
    fn,
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    query = query.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty_like(query)
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    fn(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.shape[1],
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        scale,
        sliding_window or 0,
        int(query.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out
