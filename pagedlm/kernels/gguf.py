"""Wrappers of the quantized-GGUF matmul kernels (csrc/gguf_matmul.c).

- `gguf_gemv`: y = x W^T straight from the packed weight, activations quantized to int8 per
  32-value block, integer dot products (AVX-512 VNNI, AVX2, or portable C): decode-sized
  batches, and every batch where the GEMM below is not compiled in (AVX2 machines).
- `gguf_gemm`: the same product for larger batches (prefill), an integer GEMM on weight tiles
  unpacked to int8 in a per-thread scratch (AVX-512 VNNI only); on K-quants the activations
  are quantized per 256 values (ggml's Q8_K) and the sub-blocks combine in int32.
- `int8_gemm_amx`, `int8_gemm_vnni`: the GEMM of per-channel int8 weights (`pack_q8`) on
  AMX-INT8, else AVX-512 VNNI, activations quantized per the weight's `activation_block`
  values or per token (`channel_act_block`), each block's dots summed in int32
  (csrc/int8_gemm_amx.c, csrc/int8_gemm_vnni.c); `gguf_gemm` takes one of them for those
  weights wherever either runs.
- `gguf_dequantize_rows`: a tile of W rows as bf16/fp32, for prefill GEMMs on oneDNN.
- `quantize_rows_q8`: the kernels' activation quantization alone (for the tests).

The layout is `pagedlm.kernels.gguf_pack.PackedGGUFWeight`; its PyTorch twins
(`dequantize_packed`, `quantize_activations`) are the oracle.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from pagedlm.kernels.cpu import _FLOATS, _i64, _int, _ptr, checked, cpu_kernels, declare
from pagedlm.kernels.gguf_pack import TILE_ROWS, PackedGGUFWeight

declare("gguf_vnni_compiled", [], _int)
declare("gguf_avx2_compiled", [], _int)


def gguf_isa() -> str | None:
    """The fastest quantized GEMV here: "avx512_vnni", "avx2", "portable", or None (no C
    kernels)."""
    lib = cpu_kernels()
    return None if lib is None else _isa_of(lib)


@functools.cache
def _isa_of(lib) -> str:
    if lib.gguf_vnni_compiled():
        return "avx512_vnni"
    return "avx2" if lib.gguf_avx2_compiled() else "portable"


_WEIGHT_FIELDS = tuple(f.name for f in dataclasses.fields(PackedGGUFWeight))


def _weight_args(fn: str, w: PackedGGUFWeight) -> tuple:
    """The packed tensors' pointers (qs, qh, scales, mins, super_scales, super_mins), checked;
    cached on `w` (decode calls every layer each step) and re-checked whenever one of its
    fields was replaced."""
    key = tuple(getattr(w, name) for name in _WEIGHT_FIELDS)
    cached = w.__dict__.get("_kernel_args")
    if cached is not None and all(
        a is b if isinstance(a, torch.Tensor) or a is None else a == b
        for a, b in zip(key, cached[0], strict=True)
    ):
        return cached[1]
    args = _check_weight(fn, w)
    w.__dict__["_kernel_args"] = (key, args)
    return args


# scales dtype -> the kernels' SCALES_* (gguf_common.h): fp32, fp16, int8 / uint8 sub-scales
# times the K-quants' fp32 super-block scales
_SCALE_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2, torch.uint8: 3}


def _check_weight(fn: str, w: PackedGGUFWeight) -> tuple:
    n, k = w.shape
    tiles, subs = -(-n // TILE_ROWS), k // w.group
    quads = k // 4 if w.bits == 8 else k // 8
    if (w.qh is None) != (w.bits not in (5, 6)):
        raise ValueError(f"{fn}: {w.bits}-bit weights {'need' if w.qh is None else 'take no'} qh")
    scale_shape, super_shape = (tiles, subs, TILE_ROWS), (tiles, k // 256, TILE_ROWS)
    scales = checked(fn, "scales", w.scales, tuple(_SCALE_KINDS), scale_shape)
    kind = _SCALE_KINDS[w.scales.dtype]
    needs_super = kind >= 2
    if needs_super != (w.super_scales is not None):
        verb = "need" if needs_super else "take no"
        raise ValueError(f"{fn}: {w.scales.dtype} scales {verb} super_scales")
    if (w.super_mins is not None) != (needs_super and w.mins is not None):
        raise ValueError(f"{fn}: super_mins go with the mins of super-block scales only")
    supers = [
        None if v is None else checked(fn, name, v, torch.float32, super_shape)
        for name, v in (("super_scales", w.super_scales), ("super_mins", w.super_mins))
    ]
    return (
        checked(fn, "qs", w.qs, torch.uint8, (tiles, quads, 64)),
        None
        if w.qh is None
        else checked(fn, "qh", w.qh, torch.uint8, (tiles, k // 8, 16 * (w.bits - 4))),
        scales,
        None if w.mins is None else checked(fn, "mins", w.mins, w.scales.dtype, scale_shape),
        *supers,
    )


def _layout(w: PackedGGUFWeight) -> tuple[int, int, int, int]:
    """(bits, group, offset, scale kind): the layout arguments every kernel takes."""
    return w.bits, w.group, w.offset, _SCALE_KINDS[w.scales.dtype]


def _matmul_args(
    fn: str,
    x: torch.Tensor,
    w: PackedGGUFWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    y_cols: int | None = None,
) -> tuple[torch.Tensor, tuple, tuple]:
    """(y, the checked pointer arguments both kernels take first: x, qs, qh, scales, mins,
    super_scales, super_mins, bias, y; then ldy, M, N, K, bits, group, offset, scale kind,
    bf16). `out`: y given, [M, N] with contiguous rows (e.g. columns of a wider tensor).
    `y_cols`: y's columns where they are not N (a fused activation's output)."""
    n, k = w.shape
    x = x.contiguous()
    m = x.shape[0]
    if out is None:
        y = x.new_empty(m, y_cols or n)
    else:
        checked(fn, "out", out, x.dtype, (m, y_cols or n), rows_strided=True)
        y = out
    pointers = (
        checked(fn, "x", x, _FLOATS, (m, k)),
        *_weight_args(fn, w),
        None if bias is None else checked(fn, "bias", bias.contiguous(), x.dtype, (n,)),
        y.data_ptr(),
    )
    return y, pointers, (y.stride(0), m, n, k, *_layout(w), int(x.dtype == torch.bfloat16))


# x, qs, qh, scales, mins, super_scales, super_mins, bias, y, ldy, M, N, K, bits, group,
# offset, scale kind, bf16, isa, num_threads -> 1 if computed (0: bad layout, ISA not compiled
# in, or out of memory)
declare("gguf_gemv", [_ptr] * 9 + [_i64] * 4 + [_int] * 7, _int)
_ISA_CODES = {"avx512_vnni": 1, "avx2": 2, "portable": 0}


def gemv_args(
    x: torch.Tensor,
    w: PackedGGUFWeight,
    bias: torch.Tensor | None,
    isa: str | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple]:
    """(y, the whole checked argument tuple of the C `gguf_gemv`) for `gguf_gemv` below and
    the decode plan, which calls the kernel with it directly."""
    isa = isa or gguf_isa()
    y, pointers, sizes = _matmul_args("gguf_gemv", x, w, bias, out)
    return y, (*pointers, *sizes, _ISA_CODES[isa], torch.get_num_threads())


def gguf_gemv(
    x: torch.Tensor,
    w: PackedGGUFWeight,
    bias: torch.Tensor | None,
    isa: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """x [M, K] (bf16/fp32) @ W^T (+ bias) -> [M, N] in x's dtype; None without C kernels.
    `isa`: "avx512_vnni", "avx2" or "portable" (tests); None takes the fastest. `out`: an
    [M, N] view with contiguous rows (e.g. columns of a wider tensor) to write into instead."""
    lib = cpu_kernels()
    if lib is None:
        return None
    y, args = gemv_args(x, w, bias, isa, out)
    if not lib.gguf_gemv(*args):
        raise MemoryError(f"gguf_gemv: out of memory or {isa or gguf_isa()} not compiled in")
    return y


declare("gguf_gemm_compiled", [], _int)
# x, qs, qh, scales, mins, super_scales, super_mins, bias, y, ldy, M, N, K, act_block, bits,
# group, offset, scale kind, bf16, num_threads -> 1 if computed (0: bad layout or act_block, no
# AVX-512 VNNI compiled in, or out of memory)
declare("gguf_gemm", [_ptr] * 9 + [_i64] * 5 + [_int] * 6, _int)


declare("int8_gemm_amx_supported", [], _int)
declare("int8_gemm_vnni_compiled", [], _int)
# x, qs, channel scales, bias, y, ldy, M, N, K, act_block, bf16, silu_and_mul, num_threads -> 1
# if computed (int8_gemm_vnni: the same)
declare("int8_gemm_amx", [_ptr] * 5 + [_i64] * 5 + [_int] * 3, _int)
declare("int8_gemm_vnni", [_ptr] * 5 + [_i64] * 5 + [_int] * 3, _int)


def channel_act_block(k: int, block: int | None = 128) -> int:
    """Values per activation scale in the per-channel GEMMs (`int8_gemm_amx`,
    `int8_gemm_vnni`): K where `block` is None (per token), else `block` where it is a
    multiple of 64 (their k-step) dividing K, else 128, or 64 where K is not a multiple of
    128. The layers choose (`LinearBase.activation_block`)."""
    if block is None:
        return k
    return next(b for b in (block, 128, 64) if b % 64 == 0 and k % b == 0)


def channel_gemm(w: PackedGGUFWeight, allowed: bool | None = None) -> str | None:
    """The C function of the batched product of per-channel int8 `w`: "int8_gemm_amx" where
    AMX-INT8 runs, else "int8_gemm_vnni" where AVX-512 VNNI is compiled in; None for other
    weights, without either, or with `allowed=False` (tests: `gguf_gemm`'s blocks of 32)."""
    lib = cpu_kernels()
    if w.channel_scales is None or allowed is False or lib is None:
        return None
    if lib.int8_gemm_amx_supported():
        return "int8_gemm_amx"
    return "int8_gemm_vnni" if lib.int8_gemm_vnni_compiled() else None


def gemm_args(
    x: torch.Tensor,
    w: PackedGGUFWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    channel: bool | None = None,
    silu_and_mul: bool = False,
) -> tuple[torch.Tensor, str, tuple]:
    """(y, the C function, its whole checked argument tuple) of the batched product, as
    `gemv_args`: the per-channel GEMM (`channel_gemm`; `channel=False`: never, tests), else
    `gguf_gemm`. `silu_and_mul`: y is silu(gate) * up of W's rows [gate | up], [M, N / 2],
    on the per-channel GEMM only."""
    n = w.shape[0]
    fn = channel_gemm(w, channel)
    if silu_and_mul and (fn is None or n % 64):  # as `fuses_silu_and_mul`
        raise ValueError(f"gemm_args: silu_and_mul needs a per-channel GEMM, N % 64 == 0 (N={n})")
    y_cols = n // 2 if silu_and_mul else None
    y, pointers, (ldy, m, n, k, *layout) = _matmul_args("gguf_gemm", x, w, bias, out, y_cols)
    threads = torch.get_num_threads()
    if fn is not None:
        tiles = w.qs.shape[0]
        ws = checked(fn, "channel_scales", w.channel_scales, torch.float32, (tiles * TILE_ROWS,))
        x_ptr, qs, *_, bias_ptr, y_ptr = pointers
        bf16 = layout[-1]
        qb = channel_act_block(k, w.activation_block)
        sizes = (ldy, m, n, k, qb, bf16, int(silu_and_mul), threads)
        return y, fn, (x_ptr, qs, ws, bias_ptr, y_ptr, *sizes)
    return y, "gguf_gemm", (*pointers, ldy, m, n, k, w.gemm_act_block, *layout, threads)


def fuses_silu_and_mul(w: PackedGGUFWeight) -> bool:
    """Whether the per-channel GEMM computes silu(gate) * up of w's rows [gate | up] in one
    pass (halves of whole 32-column pairs)."""
    return w.shape[0] % 64 == 0 and channel_gemm(w) is not None


def int8_gemm_silu_and_mul(
    x: torch.Tensor, w: PackedGGUFWeight, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """silu(gate) * up of x W^T (+ bias), W's rows [gate | up], by one pass of the per-channel
    GEMM that never writes the product: [M, N / 2] in x's dtype, bit for bit `silu_and_mul`
    of `gguf_gemm`'s y. None where no per-channel GEMM takes w (no AMX-INT8 nor AVX-512
    VNNI, weights not int8 per channel, N not a multiple of 64)."""
    lib = cpu_kernels()
    if lib is None or not fuses_silu_and_mul(w):
        return None
    y, fn, args = gemm_args(x, w, bias, silu_and_mul=True)
    if not getattr(lib, fn)(*args):
        raise MemoryError(f"{fn}: out of memory")
    return y


def gguf_gemm(
    x: torch.Tensor, w: PackedGGUFWeight, bias: torch.Tensor | None, channel: bool | None = None
) -> torch.Tensor | None:
    """x [M, K] (bf16/fp32) @ W^T (+ bias) -> [M, N] in x's dtype, integer dot products:
    activations quantized per `w.gemm_act_block` values (per-channel int8: per
    `channel_act_block`, from `w.activation_block`); None without C kernels, or without
    AVX-512 VNNI where AMX does not run."""
    lib = cpu_kernels()
    if lib is None:
        return None
    y, fn, args = gemm_args(x, w, bias, channel=channel)
    if fn == "gguf_gemm" and not lib.gguf_gemm_compiled():
        return None
    if not getattr(lib, fn)(*args):
        raise MemoryError(f"{fn}: out of memory")
    return y


# qs, qh, scales, mins, super_scales, super_mins, N, K, bits, group, offset, scale kind, n0,
# n1, out, bf16, num_threads -> 1 if done
declare(
    "gguf_dequantize_rows",
    [_ptr] * 6 + [_i64] * 2 + [_int] * 4 + [_i64] * 2 + [_ptr, _int, _int],
    _int,
)


def gguf_dequantize_rows(
    w: PackedGGUFWeight, n0: int, n1: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """W[n0:n1] as `dtype` (bf16/fp32), equal to `dequantize_packed`; None without C kernels."""
    lib = cpu_kernels()
    if lib is None:
        return None
    n, k = w.shape
    if not 0 <= n0 < n1 <= n:
        raise ValueError(f"gguf_dequantize_rows: rows {n0}:{n1} of {n}")
    out = torch.empty(n1 - n0, k, dtype=dtype)
    out_ptr = checked("gguf_dequantize_rows", "out", out, _FLOATS)
    args = _weight_args("gguf_dequantize_rows", w)
    bf16 = int(dtype == torch.bfloat16)
    if not lib.gguf_dequantize_rows(
        *args, n, k, *_layout(w), n0, n1, out_ptr, bf16, torch.get_num_threads()
    ):
        raise MemoryError("gguf_dequantize_rows: out of memory")
    return out


# x, M, K, bf16, block, q, d
declare("quantize_rows_q8", [_ptr, _i64, _i64, _int, _i64, _ptr, _ptr], _int)


def quantize_rows_q8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x [M, K] -> (int8 [M, K], fp32 [M, K/block]) as the kernels quantize activations in
    blocks of 32, 128 or 256 (the GEMM's `gemm_act_block`)."""
    lib = cpu_kernels()
    if lib is None:
        return None
    x = x.contiguous()
    m, k = x.shape
    if block not in (32, 128, 256) or k % block:
        raise ValueError(f"quantize_rows_q8: K = {k} in blocks of {block} (32, 128 or 256)")
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // block)
    ptr = checked("quantize_rows_q8", "x", x, _FLOATS)
    if not lib.quantize_rows_q8(
        ptr, m, k, int(x.dtype == torch.bfloat16), block, q.data_ptr(), d.data_ptr()
    ):
        raise MemoryError("quantize_rows_q8: out of memory")
    return q, d
