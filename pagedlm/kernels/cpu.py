"""Small C/OpenMP kernels for the CPU, compiled once with the system gcc into the cache dir.

- Paged attention (decode and prefill): see `cpu_attention.py`.
- `argmax_rows`: greedy sampling on bf16/fp32 logits (torch's bf16 argmax is 6x slower);
  `gumbel_argmax_rows`: random sampling from bf16/fp32 logits in one pass (no softmax, no
  noise tensor: torch's `exponential_` alone is ~16 ns a value).
- `rms_norm` (with the residual add), `silu_and_mul`, `rotary_embedding`: one pass over the
  activations instead of several PyTorch element-wise ops.
- `small_batch_linear`: x W^T for decode batches (<= 64 rows, bf16), streaming the weight from
  DRAM faster than oneDNN does at these sizes: AMX over the dense weight, or AVX-512 BF16
  (vdpbf16ps) over a blocked copy (`block_small_batch_weight`; ~1.3x oneDNN at 1 row, par at
  64), with a portable C loop for tests and tied LM heads elsewhere.

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
from typing import Any

import torch

from pagedlm import envs

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast"]

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# C function name -> (argtypes, restype), each declared by `declare` next to its wrapper.
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {}
_loaded: list[ctypes.CDLL] = []


def declare(name: str, argtypes: list[Any], restype: Any = None) -> None:
    """Declare the ctypes prototype of C function `name` (mirroring its csrc definition)."""
    _SIGNATURES[name] = (argtypes, restype)
    for lib in _loaded:
        _bind(lib, name)


def _bind(lib: ctypes.CDLL, name: str) -> None:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = _SIGNATURES[name]


def checked(
    fn: str,
    name: str,
    t: torch.Tensor,
    dtypes: torch.dtype | tuple[torch.dtype, ...],
    shape: tuple[int, ...] | None = None,
    rows_strided: bool = False,
) -> int:
    """`t.data_ptr()` after checking what the C function `fn` assumes of argument `name`: a
    CPU tensor of one of `dtypes`, contiguous (or, with `rows_strided`, 2-D with unit stride
    in the last dim), of `shape` where given. Anything else raises instead of being misread."""
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise TypeError(f"{fn}: {name} must be a CPU tensor")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{fn}: {name} must be {want}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if rows_strided:
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be 2-D with contiguous rows")
    elif not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous")
    return t.data_ptr()


SMALL_BATCH_ROWS = 64  # up to here the AMX kernel streams weights faster than oneDNN
# AVX-512 BF16's loop over a dense weight (tied LM heads; the layers' own weights are in the
# blocked copy, as fast as oneDNN's prepacked one or faster up to 64 rows) against oneDNN's
# prepacked bf16, weights streamed from memory (Zen 4, 2 cores, benchmarks/gemm_micro.py, row
# "bf16 small"): faster at 1-2 rows, 1.2-1.3x slower from 4 (the 1.5B's tied LM head at 32
# rows 52.7 against 39.6 ms): `small_batch_linear` chooses it for batches up to this
DENSE_AVX512_BF16_ROWS = 2


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a cache shared by other machines is not reused."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build() -> Path | None:
    compiler = envs.CC or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    sources = sorted(_CSRC.glob("*.c"))
    digest = hashlib.sha256(" ".join(_FLAGS).encode() + _cpu_flags().encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    target = envs.cache_dir() / "kernels" / f"pagedlm_cpu-{digest.hexdigest()[:16]}.so"
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
    if envs.PAGEDLM_DISABLE_C_KERNELS:
        return None
    try:
        path = _build()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("C kernels unavailable, using PyTorch paths: %s", e)
        return None
    import pagedlm.kernels.cpu_attention  # noqa: F401  (declares the attention prototypes)

    for name in _SIGNATURES:
        _bind(lib, name)
    lib.set_amx_disabled(int(envs.PAGEDLM_DISABLE_AMX))
    _loaded.append(lib)
    return lib


def kernels_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library if every tensor is on the CPU in one dtype, bf16 or fp32; else None."""
    dtype = tensors[0].dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    if any(t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return None
    return cpu_kernels()


_FLOATS = (torch.bfloat16, torch.float32)


def is_bf16(t: torch.Tensor) -> int:
    if t.dtype not in _FLOATS:
        raise TypeError(f"C kernels take bf16 or fp32 tensors, got {t.dtype}")
    return int(t.dtype == torch.bfloat16)


def _threads() -> int:
    return torch.get_num_threads()


def _ok(fn: str, status: int) -> None:
    """C kernels return 0 when an allocation failed (their outputs are then incomplete)."""
    if not status:
        raise MemoryError(f"C kernel {fn}: out of memory")


declare("argmax_rows", [_ptr, _i64, _i64, _int, _ptr, _int])  # logits, rows, vocab, bf16, out


def argmax_rows(lib: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bf16/fp32 -> [rows] int64, the first maximal index (as torch.argmax)."""
    logits = logits.contiguous()
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows: logits must be [rows, vocab], got {tuple(logits.shape)}")
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.argmax_rows(
        checked("argmax_rows", "logits", logits, _FLOATS),
        logits.shape[0],
        logits.shape[1],
        is_bf16(logits),
        out.data_ptr(),
        _threads(),
    )
    return out


# logits, rows, vocab, bf16, scale (or NULL), seed, out, num_threads
declare("gumbel_argmax_rows", [_ptr, _i64, _i64, _int, _ptr, ctypes.c_uint64, _ptr, _int])
declare("gumbel_argmax_vectorized", [], _int)


def gumbel_argmax_rows(
    lib: ctypes.CDLL, logits: torch.Tensor, seed: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """[rows, vocab] bf16/fp32 -> [rows] int64: per row a draw from softmax(logits * scale)
    (scale: [rows] fp32, 1 / temperature; None for 1) by the exponential race as a
    Gumbel-max, its noise a hash of (seed, row, index): see sampling.c."""
    logits = logits.contiguous()
    if logits.dim() != 2:
        raise ValueError(
            f"gumbel_argmax_rows: logits must be [rows, vocab], got {tuple(logits.shape)}"
        )
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.long)
    lib.gumbel_argmax_rows(
        checked("gumbel_argmax_rows", "logits", logits, _FLOATS),
        rows,
        logits.shape[1],
        is_bf16(logits),
        None
        if scale is None
        else checked("gumbel_argmax_rows", "scale", scale, torch.float32, (rows,)),
        seed,
        out.data_ptr(),
        _threads(),
    )
    return out


# x, residual, weight, out, rows, hidden, eps, offset, bf16, num_threads -> 0 if OOM
declare("rms_norm", [_ptr] * 4 + [_i64, _i64, _f32, _f32, _int, _int], _int)


def rms_norm_args(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    out: torch.Tensor,
) -> tuple:
    """The checked arguments of the C `rms_norm` (x contiguous; out like x)."""
    fn = "rms_norm"
    hidden = x.shape[-1]
    return (
        checked(fn, "x", x, _FLOATS),
        None if residual is None else checked(fn, "residual", residual, x.dtype, tuple(x.shape)),
        checked(fn, "weight", weight, x.dtype, (hidden,)),
        checked(fn, "out", out, x.dtype, tuple(x.shape)),
        x.numel() // hidden,
        hidden,
        eps,
        offset,
        is_bf16(x),
        _threads(),
    )


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float,
) -> torch.Tensor:
    """RMSNorm of x (+ residual) over the last dim; `residual` becomes x + residual in place."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _ok("rms_norm", lib.rms_norm(*rms_norm_args(x, residual, weight, eps, offset, out)))
    return out


declare("silu_and_mul", [_ptr, _ptr, _i64, _i64, _int, _int], _int)  # x, out, rows, d -> 0: OOM


def silu_and_mul_args(x: torch.Tensor, out: torch.Tensor) -> tuple:
    """The checked arguments of the C `silu_and_mul` (x contiguous, out [..., d])."""
    fn = "silu_and_mul"
    d = x.shape[-1] // 2
    return (
        checked(fn, "x", x, _FLOATS),
        checked(fn, "out", out, x.dtype, (*x.shape[:-1], d)),
        x.numel() // (2 * d),
        d,
        is_bf16(x),
        _threads(),
    )


def silu_and_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """[rows, 2d] = [gate | up] -> [rows, d] = silu(gate) * up."""
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    _ok("silu_and_mul", lib.silu_and_mul(*silu_and_mul_args(x, out)))
    return out


declare(
    "rotary_embedding",
    # q, k, positions, cos, sin, tokens, q_heads, k_heads, q_stride, k_stride, head_size,
    # rotary_dim, bf16, num_threads -> 0 if OOM
    [_ptr] * 5 + [_i64] * 7 + [_int, _int],
    _int,
)


def rotary_embedding_args(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_size: int,
) -> tuple:
    """The checked arguments of the C `rotary_embedding` (positions contiguous)."""
    fn = "rotary_embedding"
    tokens = query.shape[0]
    return (
        checked(fn, "query", query, _FLOATS, rows_strided=True),
        checked(fn, "key", key, query.dtype, rows_strided=True),
        checked(fn, "positions", positions, torch.int64, (tokens,)),
        checked(fn, "cos_cache", cos_cache, torch.float32),
        checked(fn, "sin_cache", sin_cache, torch.float32, tuple(cos_cache.shape)),
        tokens,
        query.shape[1] // head_size,
        key.shape[1] // head_size,
        query.stride(0),
        key.stride(0),
        head_size,
        cos_cache.shape[1],
        is_bf16(query),
        _threads(),
    )


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
    args = rotary_embedding_args(
        positions.contiguous(), query, key, cos_cache, sin_cache, head_size
    )
    _ok("rotary_embedding", lib.rotary_embedding(*args))


declare("set_amx_disabled", [_int])  # PAGEDLM_DISABLE_AMX, applied when the library loads
declare("small_batch_linear_supported", [], _int)  # AMX compiled in and granted by the OS
declare("gemv_bf16_avx512_compiled", [], _int)
declare("gemv_bf16_avx2_compiled", [], _int)


def small_batch_linear_isa() -> str | None:
    """The small-batch linear that beats oneDNN here: "amx", "avx512_bf16", "avx2" (bf16
    widened to fp32 in registers: 1.3-2.7x oneDNN's bf16 on 1-32 rows where oneDNN has no bf16
    kernel), or None (only the portable C loop, slower than oneDNN, would run)."""
    lib = cpu_kernels()
    if lib is None:
        return None
    if lib.small_batch_linear_supported():
        return "amx"
    if lib.gemv_bf16_avx512_compiled():
        return "avx512_bf16"
    if lib.gemv_bf16_avx2_compiled():
        return "avx2"
    return None


def small_batch_linear_supported() -> bool:
    """Whether a fast `small_batch_linear` (AMX, AVX-512 BF16 or AVX2) runs here."""
    return small_batch_linear_isa() is not None


# x, w, bias, y, M, N, K, num_threads -> 1 if computed (0: shape rules or no AMX)
declare("small_batch_linear", [_ptr] * 4 + [_i64] * 3 + [_int], _int)
# x, w, bias, y, M, N, K, isa (1 = AVX-512 BF16, 2 = AVX2, 0 = portable), num_threads -> 1 if
# computed
declare("gemv_bf16", [_ptr] * 4 + [_i64] * 3 + [_int, _int], _int)


def small_batch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, isa: str | None = None
) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K]^T (+ bias) for M <= SMALL_BATCH_ROWS bf16 rows; None where the
    kernel does not apply (other dtypes, more rows, no fast ISA): use another path.

    `weight` is dense [N, K] or blocked [N/16, K/2, 16, 2] (`block_small_batch_weight`).
    `isa` forces a dense path ("amx", "avx512_bf16", "avx2" or "portable"; tests, benchmarks);
    None takes the fastest (AMX where its shape rules hold, else AVX-512 BF16 up to
    DENSE_AVX512_BF16_ROWS rows, else AVX2), and None where oneDNN is faster.
    """
    if x.dim() != 2 or x.shape[0] > SMALL_BATCH_ROWS or not weight.is_contiguous():
        return None
    lib = kernels_for(x, weight) if x.dtype == torch.bfloat16 else None
    if lib is None or (bias is not None and bias.dtype != x.dtype):
        return None
    if weight.dim() == 4:
        return _blocked_linear(lib, x, weight, bias)
    if isa is None:
        isa = small_batch_linear_isa()
        if isa is None or (isa == "avx512_bf16" and x.shape[0] > DENSE_AVX512_BF16_ROWS):
            return None
    fn = "small_batch_linear"
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    args = (
        checked(fn, "x", x, torch.bfloat16),
        checked(fn, "weight", weight, torch.bfloat16, (n, k)),
        None if bias is None else checked(fn, "bias", bias.contiguous(), torch.bfloat16, (n,)),
    )
    y = x.new_empty(m, n)
    if isa == "amx":
        if lib.small_batch_linear(*args, y.data_ptr(), m, n, k, _threads()):
            return y
        if not lib.gemv_bf16_avx512_compiled():
            return None
        isa = "avx512_bf16"
    code = {"avx512_bf16": 1, "avx2": 2, "portable": 0}[isa]
    return y if lib.gemv_bf16(*args, y.data_ptr(), m, n, k, code, _threads()) else None


def block_small_batch_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The AVX-512 BF16 kernel's layout of a bf16 [N, K] weight: [N/16, K/2, 16, 2], each
    64-byte line a k pair of 16 output rows; None unless N % 16 == 0 and K is even."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 16 or k % 2:
        return None
    return weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unblock_small_batch_weight(blocked: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight of `block_small_batch_weight`'s layout (a new tensor)."""
    nblk, kp, _, _ = blocked.shape
    return blocked.permute(0, 2, 1, 3).reshape(nblk * 16, kp * 2).contiguous()


def amx_linear_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor
) -> tuple:
    """The checked arguments of the C `small_batch_linear` (AMX over the dense weight; x, bias
    contiguous; y [M, N] contiguous) for the decode plan, which calls it directly."""
    fn = "small_batch_linear (AMX)"
    m, k = x.shape
    n = weight.shape[0]
    if m > SMALL_BATCH_ROWS or n % 16 or k % 32:
        raise ValueError(f"{fn}: M={m}, N={n}, K={k} outside the kernel's rules")
    return (
        checked(fn, "x", x, torch.bfloat16),
        checked(fn, "weight", weight, torch.bfloat16, (n, k)),
        None if bias is None else checked(fn, "bias", bias, torch.bfloat16, (n,)),
        checked(fn, "y", y, torch.bfloat16, (m, n)),
        m,
        n,
        k,
        _threads(),
    )


# x, blocked w [N/16, K/2, 16, 2], bias, y, M, N/16, K/2, num_threads -> 1 if computed
declare("gemv_bf16_blocked", [_ptr] * 4 + [_i64] * 3 + [_int], _int)


def blocked_linear_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor
) -> tuple:
    """The checked arguments of the C `gemv_bf16_blocked` (x, bias contiguous; y [M, N])."""
    fn = "small_batch_linear (blocked)"
    nblk, kp = weight.shape[:2]
    n = nblk * 16
    if x.shape[1] != 2 * kp:
        raise ValueError(f"{fn}: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    return (
        checked(fn, "x", x, torch.bfloat16),
        checked(fn, "weight", weight, torch.bfloat16, (nblk, kp, 16, 2)),
        None if bias is None else checked(fn, "bias", bias, torch.bfloat16, (n,)),
        checked(fn, "y", y, torch.bfloat16, (x.shape[0], n)),
        x.shape[0],
        nblk,
        kp,
        _threads(),
    )


def _blocked_linear(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0] * 16)
    ok = lib.gemv_bf16_blocked(*blocked_linear_args(x, weight, bias, y))
    return y if ok else None
