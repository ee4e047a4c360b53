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
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["SUPPORTED_TYPES", "dequantize"]

_T = GGMLQuantizationType
_QK_K = 256
# Blocks decoded per step: keeps the uint8/float32 temporaries around L2 size.
_CHUNK_VALUES = 1 << 16


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., k) uint8 -> (..., 2, k): low nibbles first, then high nibbles."""
    return torch.stack((q & 0x0F, q >> 4), dim=-2)


_SHIFT_8 = torch.arange(8, dtype=torch.uint8)
_SHIFT_2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _bits(q: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 8, k): bit j of byte l at [:, j, l]."""
    return (q.unsqueeze(1) >> _SHIFT_8.view(1, 8, 1)) & 1


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].view(torch.int8).float().mul_(d)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:]).view(-1, 32).float().sub_(8)
    return q.mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    m = _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:]).view(-1, 32).float()
    return q.mul_(d).add_(m)


def _q5_lohi(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    # qh (n, 4) little-endian uint32: bit i -> value i == byte i//8, bit i%8.
    hi = (qh.unsqueeze(2) >> _SHIFT_8.view(1, 1, 8)) & 1  # (n, 4, 8)
    lo = _nibbles(qs)  # (n, 2, 16)
    return lo.view(-1, 32) | (hi.view(-1, 32) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _q5_lohi(b[:, 2:6], b[:, 6:]).float().sub_(16)
    return q.mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    m = _f16(b[:, 2:4])
    q = _q5_lohi(b[:, 4:8], b[:, 8:]).float()
    return q.mul_(d).add_(m)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales/mins -> two (n, 8) float32 tensors."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    dmin = _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (d * sc).unsqueeze(-1)  # (n, 8, 1)
    mins = (dmin * mn).unsqueeze(-1)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).view(n, 8, 32).float()
    return q.mul_(scale).sub_(mins).view(n, _QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    dmin = _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (d * sc).unsqueeze(-1)
    mins = (dmin * mn).unsqueeze(-1)
    lo = _nibbles(b[:, 48:].reshape(n, 4, 32)).view(n, 8, 32)
    hi = _bits(b[:, 16:48])  # (n, 8, 32)
    q = (lo | (hi << 4)).float()
    return q.mul_(scale).sub_(mins).view(n, _QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    scale = (d * sc).unsqueeze(-1)  # (n, 16, 1)
    lo = _nibbles(ql).view(n, 8, 32)
    hi = ((qh >> _SHIFT_2.view(1, 1, 4, 1)) & 3).view(n, 8, 32)
    q = (lo | (hi << 4)).view(n, 16, 16).float().sub_(32)
    return q.mul_(scale).view(n, _QK_K)


def _q8_k(b: torch.Tensor) -> torch.Tensor:
    d = b[:, :4].contiguous().view(torch.float32)
    return b[:, 4:260].view(torch.int8).float().mul_(d)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    s = b[:, :16]
    d = _f16(b[:, 80:82])
    dmin = _f16(b[:, 82:84])
    scale = (d * (s & 0x0F).float()).unsqueeze(-1)  # (n, 16, 1)
    mins = (dmin * (s >> 4).float()).unsqueeze(-1)
    qs = b[:, 16:80].reshape(n, 2, 1, 32)
    q = ((qs >> _SHIFT_2.view(1, 1, 4, 1)) & 3).view(n, 16, 16).float()
    return q.mul_(scale).sub_(mins).view(n, _QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask = b[:, :32]
    qs = b[:, 32:96].reshape(n, 2, 1, 32)
    s = b[:, 96:108]
    d = _f16(b[:, 108:110])
    lsc = _nibbles(s[:, :8]).reshape(n, 16)
    hsc = ((s[:, 8:12].unsqueeze(1) >> _SHIFT_2.view(1, 4, 1)) & 3).reshape(n, 16)
    sc = (lsc | (hsc << 4)).float().sub_(32)
    scale = (d * sc).unsqueeze(-1)  # (n, 16, 1)
    lo = ((qs >> _SHIFT_2.view(1, 1, 4, 1)) & 3).view(n, 8, 32)
    hi = _bits(hmask)  # (n, 8, 32); offset 4 applies where the bit is clear
    q = lo.float().sub_((hi ^ 1).float().mul_(4)).view(n, 16, 16)
    return q.mul_(scale).view(n, _QK_K)


_BLOCK_FNS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.Q8_0: _q8_0,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
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


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Flat uint8 torch view of ``raw``'s bytes (no copy when it is contiguous)."""
    if isinstance(raw, torch.Tensor):
        t = raw.detach().contiguous().reshape(-1)
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    with warnings.catch_warnings():
        # GGUFReader hands out read-only memmaps; we only ever read from them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def dequantize(
    raw: np.ndarray | torch.Tensor,
    qtype: int | GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode a GGML tensor's raw bytes into a torch tensor of ``shape`` and ``dtype``.

    Args:
        raw: the tensor's bytes, e.g. ``GGUFReader(...).tensors[i].data`` (uint8 for quantized
            types and BF16, float16/float32 arrays for F16/F32; any dtype/shape is read as its
            bytes). numpy arrays (including read-only memmaps) are not copied before decoding.
        qtype: the GGML type (``tensor.tensor_type``), as an enum member or int.
        shape: the logical shape in PyTorch order, i.e. ``tuple(reversed(ne))`` where ``ne`` is
            GGUF's dimension list (``GGUFReader``'s ``tensor.shape``); e.g. ``(rows, cols)``.
        dtype: result dtype. Values are computed in float32 (bit-identical to
            ``gguf.quants.dequantize``) and then cast.

    Returns:
        A new tensor (never a view of ``raw``), so the source buffer can be released.

    Raises:
        NotImplementedError: ``qtype`` is not in :data:`SUPPORTED_TYPES`.
        ValueError: the byte count does not match ``shape`` for ``qtype``.
    """
    t = _as_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    block_size, type_size = GGML_QUANT_SIZES[t]
    data = _as_bytes(raw)
    if numel % block_size or data.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{t.name} tensor of shape {shape} needs {numel // block_size * type_size} bytes "
            f"(block of {block_size} values = {type_size} bytes), got {data.numel()}"
            + (f"; {numel} values are not a multiple of {block_size}" if numel % block_size else "")
        )

    if t in _PLAIN:
        out = data.view(_PLAIN[t])
        out = out.to(dtype) if out.dtype != dtype else out.clone()
        return out.view(shape)

    fn = _BLOCK_FNS[t]
    n_blocks = numel // block_size
    blocks = data.view(n_blocks, type_size)
    out = torch.empty((n_blocks, block_size), dtype=dtype)
    step = max(1, _CHUNK_VALUES // block_size)
    if n_blocks <= step:
        out.copy_(fn(blocks))
    else:
        for start in range(0, n_blocks, step):
            stop = min(start + step, n_blocks)
            out[start:stop].copy_(fn(blocks[start:stop]))
    return out.view(shape)
