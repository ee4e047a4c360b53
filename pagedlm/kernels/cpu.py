"""Small C/OpenMP kernels for the CPU, compiled once with the system gcc into the cache dir.

- Paged attention (decode and prefill): see `cpu_attention.py`.
- `argmax_rows`: greedy sampling on bf16/fp32 logits (torch's bf16 argmax is 6x slower).
- `rms_norm` (with the residual add), `silu_and_mul`, `rotary_embedding`: one pass over the
  activations instead of several PyTorch element-wise ops.
- `small_batch_linear`: x W^T for decode batches (<= 64 rows, bf16) on AMX, streaming the
  dense weight from DRAM faster than oneDNN does at these sizes (up to ~1.5x).

When no compiler is available, or PAGEDLM_DISABLE_C_KERNELS=1, `cpu_kernels()` returns None and
callers use their PyTorch path; the tests check both against the same reference. Math is fp32;
the element-wise kernels round to bf16 exactly where the PyTorch path does. The library is
built with -march=native, so its cache key includes the CPU's feature flags.
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
_CSRC = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast"]

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "argmax_rows": [_ptr, _i64, _i64, _int, _ptr, _int],
    # x, residual, weight, out, rows, hidden, eps, offset, bf16, num_threads
    "rms_norm": [_ptr] * 4 + [_i64, _i64, _f32, _f32, _int, _int],
    "silu_and_mul": [_ptr, _ptr, _i64, _i64, _int, _int],
    # q, k, positions, cos, sin, tokens, q_heads, k_heads, q_stride, k_stride, head_size,
    # rotary_dim, bf16, num_threads
    "rotary_embedding": [_ptr] * 5 + [_i64] * 7 + [_int, _int],
    # x, w, bias, y, M, N, K, num_threads -> 1 if computed
    "small_batch_linear": [_ptr] * 4 + [_i64] * 3 + [_int],
    "small_batch_linear_supported": [],
}
_RETURNS_INT = ("small_batch_linear", "small_batch_linear_supported")
SMALL_BATCH_ROWS = 64  # up to here the AMX kernel streams weights faster than oneDNN


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a cache shared by other machines is not reused."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build() -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    from pagedlm.model_loader.catalog import cache_dir

    sources = sorted(_CSRC.glob("*.c"))
    digest = hashlib.sha256(" ".join(_FLAGS).encode() + _cpu_flags().encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    target = cache_dir() / "kernels" / f"pagedlm_cpu-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *_FLAGS, *map(str, sources), "-o", str(out), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("C kernel build failed, using PyTorch paths: %s", result.stderr)
            return None
        os.replace(out, target)
    for stale in target.parent.glob("pagedlm_cpu-*.so"):  # builds of older sources
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


@lru_cache(maxsize=1)
def cpu_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (no compiler, or PAGEDLM_DISABLE_C_KERNELS=1)."""
    if os.environ.get("PAGEDLM_DISABLE_C_KERNELS") == "1":
        return None
    try:
        path = _build()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("C kernels unavailable, using PyTorch paths: %s", e)
        return None
    from pagedlm.kernels.cpu_attention import RETURNS_INT, SIGNATURES

    for name, argtypes in {**_SIGNATURES, **SIGNATURES}.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int if name in _RETURNS_INT + RETURNS_INT else None
    return lib


def kernels_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library if every tensor is on the CPU in one dtype, bf16 or fp32; else None."""
    dtype = tensors[0].dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    if any(t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return None
    return cpu_kernels()


def is_bf16(t: torch.Tensor) -> int:
    if t.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"C kernels take bf16 or fp32 tensors, got {t.dtype}")
    return int(t.dtype == torch.bfloat16)


def argmax_rows(lib: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bf16/fp32 -> [rows] int64, the first maximal index (as torch.argmax)."""
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.argmax_rows(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        is_bf16(logits),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float,
) -> torch.Tensor:
    """RMSNorm of x (+ residual) over the last dim; `residual` becomes x + residual in place."""
    hidden = x.shape[-1]
    x = x.contiguous()
    assert residual is None or residual.is_contiguous()
    out = torch.empty_like(x)
    lib.rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
        offset,
        is_bf16(x),
        torch.get_num_threads(),
    )
    return out


def silu_and_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """[rows, 2d] = [gate | up] -> [rows, d] = silu(gate) * up."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], d)
    lib.silu_and_mul(
        x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d, is_bf16(x), torch.get_num_threads()
    )
    return out


def rotary_embedding(
    lib: ctypes.CDLL,
    positions: torch.Tensor,  # [tokens] int64
    query: torch.Tensor,  # [tokens, q_heads * head_size], rows may be strided
    key: torch.Tensor,  # [tokens, k_heads * head_size]
    cos_cache: torch.Tensor,  # [max_position, rotary_dim] fp32
    sin_cache: torch.Tensor,
    head_size: int,
) -> None:
    """NeoX RoPE applied in place to the first rotary_dim dims of each head."""
    assert query.stride(-1) == 1 and key.stride(-1) == 1
    lib.rotary_embedding(
        query.data_ptr(),
        key.data_ptr(),
        positions.contiguous().data_ptr(),
        cos_cache.data_ptr(),
        sin_cache.data_ptr(),
        query.shape[0],
        query.shape[1] // head_size,
        key.shape[1] // head_size,
        query.stride(0),
        key.stride(0),
        head_size,
        cos_cache.shape[1],
        is_bf16(query),
        torch.get_num_threads(),
    )


def small_batch_linear_supported() -> bool:
    """Whether `small_batch_linear` runs here (compiled with AMX, and the OS grants it)."""
    lib = cpu_kernels()
    return lib is not None and bool(lib.small_batch_linear_supported())


def small_batch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K]^T (+ bias) for M <= SMALL_BATCH_ROWS bf16 rows on AMX; None
    where the kernel does not apply (other dtypes or shapes, no AMX): use another path."""
    if x.dim() != 2 or x.shape[0] > SMALL_BATCH_ROWS or not weight.is_contiguous():
        return None
    lib = kernels_for(x, weight) if x.dtype == torch.bfloat16 else None
    if lib is None or (bias is not None and bias.dtype != x.dtype):
        return None
    x = x.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    ok = lib.small_batch_linear(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        y.data_ptr(),
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
        torch.get_num_threads(),
    )
    return y if ok else None
