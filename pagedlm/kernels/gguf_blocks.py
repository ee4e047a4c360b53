"""GGML block decoders for :func:`gguf_quants.dequantize`: each takes a tensor's raw blocks
(``[num_blocks, type_size]`` uint8) and returns a body that decodes a slice of blocks into
float32, operation by operation as ggml's reference does.

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

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

_T = GGMLQuantizationType

Body = Callable[[slice, torch.Tensor], None]


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


def _q8_0(b: torch.Tensor) -> Body:
    d = _f16(b[:, :2])

    def body(sl: slice, o: torch.Tensor) -> None:
        o.copy_(b[sl, 2:].view(torch.int8))
        o.mul_(d[sl])

    return body


def _q8_k(b: torch.Tensor) -> Body:
    d = b[:, :4].contiguous().view(torch.float32)

    def body(sl: slice, o: torch.Tensor) -> None:
        o.copy_(b[sl, 4:260].view(torch.int8))
        o.mul_(d[sl])

    return body


def _q4_01(b: torch.Tensor, affine: bool) -> Body:
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


def _q5_01(b: torch.Tensor, affine: bool) -> Body:
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


def _q45_k(b: torch.Tensor, five: bool) -> Body:
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


def _q6_k(b: torch.Tensor) -> Body:
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


def _q2_k(b: torch.Tensor) -> Body:
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


def _q3_k(b: torch.Tensor) -> Body:
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


BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], Body]] = {
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
