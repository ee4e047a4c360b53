"""Vectorized dequantization of GGML tensors (as stored in GGUF files) with torch.

Entry point: :func:`dequantize`. A tensor's raw bytes are viewed as ``[num_blocks, type_size]``
uint8 and every block is decoded at once with tensor ops (the work is split into chunks of a few
thousand blocks only to keep temporaries cache-sized; there is no per-block Python loop). The
arithmetic mirrors ggml's reference (and ``gguf.quants``) operation by operation in float32, so
the float32 result is bit-identical to ``gguf.quants.dequantize``.

Shapes: GGUF stores a tensor's dimensions as ``ne`` (fastest-varying first); ``dequantize`` wants
the logical PyTorch shape, i.e. ``tuple(reversed(ne))`` -- ``(rows, cols)`` for a matrix.
``gguf.GGUFReader``'s ``tensor.shape`` is in ``ne`` order; its ``tensor.data`` is shaped
``reversed(ne)`` for F16/F32 (typed arrays) but, for every other type including BF16, is a uint8
array of shape ``(*reversed(ne)[:-1], bytes_per_row)``. Both forms are accepted (only the bytes
matter; ``raw`` is flattened).

Block layouts (little-endian; ``fp16`` = IEEE half; QK_K = 256; a "super-block" is 256 values):

* F32 / F16 / BF16: plain arrays, one element per "block".
* Q8_0 (32 values, 34 B):  ``d:fp16, qs:int8[32]``;                       x = d*q.
* Q4_0 (32 values, 18 B):  ``d:fp16, qs:u8[16]``; value j<16 is the low nibble of qs[j],
  value j+16 the high nibble;                                               x = d*(q-8).
* Q4_1 (32 values, 20 B):  ``d:fp16, m:fp16, qs:u8[16]`` (nibbles as Q4_0); x = d*q + m.
* Q5_0 (32 values, 22 B):  ``d:fp16, qh:u8[4], qs:u8[16]``; bit j of the little-endian uint32
  qh is bit 4 of value j;                                                    x = d*(q-16).
* Q5_1 (32 values, 24 B):  ``d:fp16, m:fp16, qh:u8[4], qs:u8[16]``;        x = d*q + m.
* Q2_K (256, 84 B):  ``scales:u8[16], qs:u8[64], d:fp16, dmin:fp16``; 16 sub-blocks of 16;
  scales byte = (min << 4) | scale; 2-bit q: 32-byte group g, shift 2s -> sub-block 8g+2s..;
  x = (d*scale)*q - dmin*min.
* Q3_K (256, 110 B): ``hmask:u8[32], qs:u8[64], scales:u8[12], d:fp16``; 16 sub-blocks of 16,
  6-bit signed scales (low 4 bits from bytes 0..7, high 2 bits from bytes 8..11, minus 32);
  q = 2 low bits from qs - (4 if the hmask bit is *clear*);            x = (d*scale)*q.
* Q4_K (256, 144 B): ``d:fp16, dmin:fp16, scales:u8[12], qs:u8[128]``; 8 sub-blocks of 32 with
  6-bit scale and min packed in 12 bytes (bytes 0-3: scale 0-3 + 2 high bits of scale 4-7,
  4-7: min 0-3 + 2 high bits of min 4-7, 8-11: low nibble scale 4-7, high nibble min 4-7);
  qs 32-byte chunk c holds sub-block 2c (low nibbles) and 2c+1 (high nibbles);
  x = (d*scale)*q - dmin*min.
* Q5_K (256, 176 B): ``d, dmin, scales:u8[12], qh:u8[32], qs:u8[128]``; as Q4_K plus bit j of
  qh[l] is bit 4 of value l of sub-block j.
* Q6_K (256, 210 B): ``ql:u8[128], qh:u8[64], scales:int8[16], d:fp16``; 16 sub-blocks of 16;
  per 128-value half h: ql[64h..] low nibbles -> values 0..63, high nibbles -> 64..127;
  qh[32h+l] bits 2s..2s+1 are bits 4-5 of value 32s+l;                x = (d*scale)*(q-32).
* Q8_K (256, 292 B): ``d:fp32, qs:int8[256], bsums:int16[16]`` (bsums unused); x = d*q.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["SUPPORTED_TYPES", "dequantize"]

_T = GGMLQuantizationType
# Values decoded per step. Per-block scales are computed for the whole tensor at once; the
# bulk (quants -> float32) runs in chunks so temporaries stay in L2 and per-op overhead stays
# small next to the work.
_CHUNK_VALUES = 1 << 18

_Body = Callable[[slice, torch.Tensor], None]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2k) uint8 -> (n, k) float32: k consecutive fp16 fields."""
    return b.contiguous().view(torch.float16).float()


# Bit twiddling runs on int64 "lanes" of 8 bytes each (little-endian, so byte k of a lane is
# byte k in memory): one int64 op with a scalar operand handles 8 quants, and byte masks keep
# neighbours from mixing. Only contiguous, scalar-operand ops are used on the bulk: torch's
# broadcasting with short inner dimensions is an order of magnitude slower.
def _lanes(b: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """(n, 8k) uint8 -> (n, k) int64 (or int32) over the same bytes; copies only if it must."""
    try:
        return b.view(dtype)
    except RuntimeError:  # misaligned row stride or storage offset
        return b.clone(memory_format=torch.contiguous_format).view(dtype)


def _signed(v: int, width: int = 8) -> int:
    """Unsigned ``width``-byte constant -> the signed value with the same bits."""
    return v - (1 << 8 * width) if v >= 1 << (8 * width - 1) else v


def _rep(byte: int, width: int = 8) -> int:
    """``byte`` repeated in all ``width`` bytes of a signed integer."""
    return _signed(int.from_bytes(bytes([byte]) * width, "little"), width)


_M03, _M0F, _M30 = _rep(0x03), _rep(0x0F), _rep(0x30)


def _nibbles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lanes -> (low nibbles, high nibbles), each byte in 0..15."""
    return x & _M0F, (x >> 4).bitwise_and_(_M0F)


def _bit_at(x: torch.Tensor, j: int, pos: int) -> torch.Tensor:
    """Lanes -> lanes whose bytes hold bit ``j`` of x's bytes, moved to bit ``pos``."""
    y = x << (pos - j) if pos >= j else x >> (j - pos)
    return y.bitwise_and_(_rep(1 << pos))


_BIT_J_OF_BYTE_J = _signed(0x8040201008040201)


def _spread16(qh: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, k) lanes: byte j of lane i is 16 if bit j of qh[:, i] is set, else 0.

    Copy the byte into all 8 bytes, keep bit j in byte j, then add 0x7F per byte (no carry:
    the byte is 0 or a single bit) so that bit 7 is set exactly when bit j was, and move it
    to bit 4.
    """
    t = qh.long().mul_(0x01010101)  # bytes 0-3 (no signed overflow)
    t.bitwise_or_(t << 32).bitwise_and_(_BIT_J_OF_BYTE_J)
    return t.add_(_rep(0x7F)).bitwise_right_shift_(3).bitwise_and_(_rep(0x10))


def _as_u8(v: torch.Tensor, n: int, *shape: int) -> torch.Tensor:
    return v.view(torch.uint8).view(n, *shape)


def _q8_0(b: torch.Tensor) -> _Body:
    d = _f16(b[:, :2])

    def body(sl: slice, o: torch.Tensor) -> None:
        o.copy_(b[sl, 2:].view(torch.int8))
        o.mul_(d[sl])

    return body


def _q8_k(b: torch.Tensor) -> _Body:
    d = b[:, :4].contiguous().view(torch.float32)

    def body(sl: slice, o: torch.Tensor) -> None:
        o.copy_(b[sl, 4:260].view(torch.int8))
        o.mul_(d[sl])

    return body


def _q4_01(b: torch.Tensor, affine: bool) -> _Body:
    """Q4_0 (x = d*(q-8)) and Q4_1 (x = d*q + m)."""
    dm = _f16(b[:, : 4 if affine else 2])
    start = 4 if affine else 2

    def body(sl: slice, o: torch.Tensor) -> None:
        x = _lanes(b[sl, start:])  # (k, 2)
        k = x.shape[0]
        q = _as_u8(torch.stack(_nibbles(x), dim=1), k, 32)  # low nibbles are values 0-15
        if affine:
            o.copy_(q)
            o.mul_(dm[sl, :1]).add_(dm[sl, 1:])
        else:
            o.copy_(q.sub_(8).view(torch.int8))  # wraps to the int8 value q - 8
            o.mul_(dm[sl])

    return body


def _q5_01(b: torch.Tensor, affine: bool) -> _Body:
    """Q5_0 (x = d*(q-16)) and Q5_1 (x = d*q + m)."""
    dm = _f16(b[:, : 4 if affine else 2])
    start = 4 if affine else 2

    def body(sl: slice, o: torch.Tensor) -> None:
        x = _lanes(b[sl, start + 4 :])  # (k, 2)
        k = x.shape[0]
        hi = _spread16(b[sl, start : start + 4])  # (k, 4): bit i of qh -> value i
        q = _as_u8(torch.stack(_nibbles(x), dim=1).view(k, 4).bitwise_or_(hi), k, 32)
        if affine:
            o.copy_(q)
            o.mul_(dm[sl, :1]).add_(dm[sl, 1:])
        else:
            o.copy_(q.sub_(16).view(torch.int8))
            o.mul_(dm[sl])

    return body


def _k_scale_min(s: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K 12 packed bytes -> (n, 16) float32: 8 six-bit scales, then 8 mins.

    Works on 4-byte lanes: D = bytes 0-3, M = bytes 4-7, X = bytes 8-11.
    """
    w = _lanes(s, torch.int32)
    d, m, x = w[:, 0], w[:, 1], w[:, 2]
    m3f, m30, m0f = _rep(0x3F, 4), _rep(0x30, 4), _rep(0x0F, 4)
    sc_hi = (x & m0f) | ((d >> 2) & m30)
    mn_hi = ((x >> 4) & m0f) | ((m >> 2) & m30)
    packed = torch.stack((d & m3f, sc_hi, m & m3f, mn_hi), dim=1)  # (n, 4) int32
    return packed.view(torch.uint8).float()


def _q45_k(b: torch.Tensor, five: bool) -> _Body:
    """Q4_K / Q5_K: x = (d*scale)*q - dmin*min per 32-value sub-block."""
    sm = _k_scale_min(b[:, 4:16])
    dm = _f16(b[:, :4])
    scale = dm[:, :1] * sm[:, :8]  # (n, 8)
    mins = dm[:, 1:] * sm[:, 8:]
    qs = 48 if five else 16

    def body(sl: slice, o: torch.Tensor) -> None:
        x = _lanes(b[sl, qs:])  # (k, 16): chunk c = lanes 4c..4c+3
        k = x.shape[0]
        lo, hi = _nibbles(x)
        q = torch.stack((lo.view(k, 4, 4), hi.view(k, 4, 4)), dim=2).view(k, 8, 4)
        if five:  # bit j of qh[l] is bit 4 of value l of sub-block j
            qh = _lanes(b[sl, 16:48])  # (k, 4)
            q.bitwise_or_(torch.stack([_bit_at(qh, j, 4) for j in range(8)], dim=1))
        ov = o.view(k, 8, 32)
        ov.copy_(_as_u8(q, k, 8, 32))
        ov.mul_(scale[sl, :, None]).sub_(mins[sl, :, None])

    return body


def _q6_k(b: torch.Tensor) -> _Body:
    sc = b[:, 192:208].view(torch.int8).float()
    scale = _f16(b[:, 208:210]) * sc  # (n, 16)

    def body(sl: slice, o: torch.Tensor) -> None:
        x = _lanes(b[sl, :128])  # (k, 16): half h = lanes 8h..8h+7
        k = x.shape[0]
        y = _lanes(b[sl, 128:192]).view(k, 2, 4)  # half h = 32 bytes
        lo0, lo1 = (t.view(k, 2, 8) for t in _nibbles(x))
        # bits 2s..2s+1 of qh byte l (half h) are bits 4-5 of value 32s+l of that half;
        # low nibbles give values 0-63, high nibbles 64-127.
        c = [_bit_at(y, 2 * s_, 4) | _bit_at(y, 2 * s_ + 1, 5) for s_ in range(4)]
        v0 = lo0.bitwise_or_(torch.cat(c[:2], dim=2))
        v1 = lo1.bitwise_or_(torch.cat(c[2:], dim=2))
        q = _as_u8(torch.stack((v0, v1), dim=2), k, 256)
        o.copy_(q.sub_(32).view(torch.int8))
        o.view(k, 16, 16).mul_(scale[sl, :, None])

    return body


def _q2_k(b: torch.Tensor) -> _Body:
    s = b[:, :16]
    dm = _f16(b[:, 80:84])
    scale = dm[:, :1] * (s & 0x0F).float()  # (n, 16)
    mins = dm[:, 1:] * (s >> 4).float()

    def body(sl: slice, o: torch.Tensor) -> None:
        y = _lanes(b[sl, 16:80])  # (k, 8): half h = lanes 4h..4h+3
        k = y.shape[0]
        c = [(y >> (2 * s_)).bitwise_and_(_M03).view(k, 2, 4) for s_ in range(4)]
        q = _as_u8(torch.stack(c, dim=2), k, 16, 16)
        ov = o.view(k, 16, 16)
        ov.copy_(q)
        ov.mul_(scale[sl, :, None]).sub_(mins[sl, :, None])

    return body


def _q3_k(b: torch.Tensor) -> _Body:
    n = b.shape[0]
    # 16 six-bit scales: low nibbles of bytes 0-7, then their high nibbles; bits 4-5 are
    # bit pairs 0,2,4,6 of bytes 8-11 (4-byte lanes).
    w = _lanes(b[:, 96:108], torch.int32)  # (n, 3)
    l0, l1 = w[:, :2] & _rep(0x0F, 4), (w[:, :2] >> 4) & _rep(0x0F, 4)
    h = [(w[:, 2:] >> (2 * s_)) & _rep(0x03, 4) for s_ in range(4)]
    lsc = torch.cat((l0, l1), dim=1)
    hsc = torch.cat(h, dim=1)
    sc = (lsc | (hsc << 4)).view(torch.uint8).view(n, 16).float().sub_(32)
    scale = _f16(b[:, 108:110]) * sc  # (n, 16)

    def body(sl: slice, o: torch.Tensor) -> None:
        y = _lanes(b[sl, 32:96])  # (k, 8): 2-bit parts as Q2_K
        k = y.shape[0]
        hm = _lanes(b[sl, :32])  # (k, 4): bit j of hmask[l] -> value l of plane j
        c = [(y >> (2 * s_)).bitwise_and_(_M03).view(k, 2, 4) for s_ in range(4)]
        q = torch.stack(c, dim=2).view(k, 8, 4)
        q.bitwise_or_(torch.stack([_bit_at(hm, j, 2) for j in range(8)], dim=1))
        # q - 4 is the value: the hmask bit set means "no -4".
        ov = o.view(k, 16, 16)
        ov.copy_(_as_u8(q, k, 16, 16).sub_(4).view(torch.int8))
        ov.mul_(scale[sl, :, None])

    return body


_BLOCK_FNS: dict[GGMLQuantizationType, Callable[[torch.Tensor], _Body]] = {
    _T.Q8_0: _q8_0,
    _T.Q5_0: lambda b: _q5_01(b, affine=False),
    _T.Q5_1: lambda b: _q5_01(b, affine=True),
    _T.Q4_0: lambda b: _q4_01(b, affine=False),
    _T.Q4_1: lambda b: _q4_01(b, affine=True),
    _T.Q4_K: lambda b: _q45_k(b, five=False),
    _T.Q5_K: lambda b: _q45_k(b, five=True),
    _T.Q6_K: _q6_k,
    _T.Q8_K: _q8_k,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
}


_PLAIN: dict[GGMLQuantizationType, torch.dtype] = {
    _T.F32: torch.float32,
    _T.F16: torch.float16,
    _T.BF16: torch.bfloat16,
}

#: GGML types :func:`dequantize` handles.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_PLAIN) | frozenset(_BLOCK_FNS)


def _supported_names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))


def _as_qtype(qtype: int | GGMLQuantizationType) -> GGMLQuantizationType:
    try:
        t = GGMLQuantizationType(int(qtype))
    except ValueError:
        raise NotImplementedError(
            f"Unknown GGML type {qtype!r}; supported types: {_supported_names()}"
        ) from None
    if t not in SUPPORTED_TYPES:
        raise NotImplementedError(
            f"Dequantizing GGML type {t.name} is not supported; "
            f"supported types: {_supported_names()}"
        )
    return t


def _as_bytes(raw: np.ndarray | torch.Tensor | bytes) -> torch.Tensor:
    """Flat uint8 CPU torch view of ``raw``'s bytes (no copy when it is contiguous)."""
    if isinstance(raw, torch.Tensor):
        t = raw.detach().cpu().contiguous().reshape(-1)
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    with warnings.catch_warnings():
        # GGUFReader hands out read-only memmaps; we only ever read from them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def dequantize(
    raw: np.ndarray | torch.Tensor | bytes,
    qtype: int | GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode a GGML tensor's raw bytes into a torch tensor of ``shape`` and ``dtype``.

    Args:
        raw: the tensor's bytes, e.g. ``GGUFReader(...).tensors[i].data`` (uint8 for quantized
            types and BF16, float16/float32 arrays for F16/F32; any dtype and shape is read as
            its bytes in C order). numpy arrays, read-only memmaps included, and CPU tensors
            are not copied before decoding.
        qtype: the GGML type (``tensor.tensor_type``), as an enum member or int.
        shape: the logical shape in PyTorch order, i.e. ``tuple(reversed(ne))`` where ``ne`` is
            GGUF's dimension list (``GGUFReader``'s ``tensor.shape``); e.g. ``(rows, cols)``.
            Its last dimension (``ne[0]``) must be a whole number of blocks, as in ggml.
        dtype: result dtype. Values are computed in float32 (bit-identical to
            ``gguf.quants.dequantize``) and then cast.

    Returns:
        A new contiguous CPU tensor (never a view of ``raw``), so the source can be released.
        Quantized types are decoded in the calling thread alone (see ``_one_thread``); to use
        several cores, decode different tensors from several threads.

    Raises:
        NotImplementedError: ``qtype`` is not in :data:`SUPPORTED_TYPES`.
        ValueError: ``shape`` does not fit ``qtype``'s blocks or the byte count.
    """
    t = _as_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    block_size, type_size = GGML_QUANT_SIZES[t]
    if any(s < 0 for s in shape) or (shape and shape[-1] % block_size):
        raise ValueError(
            f"{t.name} tensor shape {shape}: the last dimension (GGUF ne[0]) must be a multiple "
            f"of the {block_size}-value block; pass the PyTorch-order shape, reversed(ne)"
        )
    data = _as_bytes(raw)
    if data.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{t.name} tensor of shape {shape} takes {numel // block_size * type_size} bytes "
            f"({block_size} values per {type_size}-byte block), got {data.numel()}"
        )

    if t in _PLAIN:
        return _empty(shape, dtype).copy_(data.view(_PLAIN[t]).view(shape))

    n_blocks = numel // block_size
    out = _empty((n_blocks, block_size), dtype)
    if n_blocks:
        with _one_thread():
            _decode(t, data.view(n_blocks, type_size), out, dtype)
    return out.view(shape)


def _decode(
    t: GGMLQuantizationType, blocks: torch.Tensor, out: torch.Tensor, dtype: torch.dtype
) -> None:
    n_blocks, block_size = out.shape
    body = _BLOCK_FNS[t](blocks)
    step = max(1, _CHUNK_VALUES // block_size)
    # float32 is written in place; other dtypes go through a float32 scratch buffer.
    scratch = None if dtype == torch.float32 else torch.empty(min(step, n_blocks), block_size)
    for start in range(0, n_blocks, step):
        sl = slice(start, min(start + step, n_blocks))
        if scratch is None:
            body(sl, out[sl])
        else:
            o = scratch[: sl.stop - start]
            body(sl, o)
            out[sl].copy_(o)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch ops in the calling thread only, for the duration of the block.

    The decode is a stream of short ops; with intra-op threads each one ends in a barrier, and
    when the cores are busy with other work every barrier waits for a descheduled thread (we
    measured 10-60x slowdowns on 2 shared cores). torch's thread count is per calling thread
    (OpenMP), so other threads are not affected.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialized tensor backed by numpy memory.

    numpy asks the kernel for transparent huge pages on large allocations and torch's CPU
    allocator does not; first-touching a fresh multi-MB output costs about half as much then.
    """
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < 1 << 22:  # below numpy's huge-page threshold: nothing to gain
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
    return buf.view(dtype).view(shape)
