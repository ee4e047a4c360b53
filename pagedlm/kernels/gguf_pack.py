"""GGUF quantized weights repacked at load into one layout the matmul kernels read.

Every supported type is written as ``W[n][k] = scale[n][k // G] * (q[n][k] - offset) -
min[n][k // G]`` with q unsigned and ``bits`` wide and scale/min per sub-block of G values,
stored as the GGUF block holds them: one fp16 value for the 32-value types; for the K-quants
an 8-bit sub-scale (and sub-min) times the 256-value super-block's fp32 ``d`` (and ``dmin``),
a product formed in fp32 as ggml's reference forms it, so dequantizing gives exactly its
float32 values.

Rows are stored in tiles of 16 (the last one padded with zero quants, scales and mins), each
in VNNI order: a 64-byte vector holds 4 consecutive values ("a k-quad") of each of the 16
rows, byte 4 r + i = q[16 t + r][4 j + i], which one ``vpdpbusd`` multiplies with 4 activation
quants broadcast. Per tile t:

* 8-bit q (Q8_0, stored as q + 128): ``qs[t][j]`` is the vector of k-quad j, as it is;
* 4/5/6-bit q: ``qs[t][s]`` holds k-quads 2s (low nibbles) and 2s + 1 (high nibbles), and for
  5/6 bits ``qh[t][s]`` holds per extra bit p = 0, 1 two 64-bit masks (k-quad 2s, then 2s + 1)
  whose bit 4 r + i is bit 4 + p of that value;
* ``scales[t][g]`` (and ``mins[t][g]``): the 16 rows' values for sub-block g; K-quants also
  ``super_scales[t][b]`` (and ``super_mins[t][b]``) for super-block b.

=====  ====  ==  ======  ==========  ==============  ================================
type   bits  G   offset  scale       min             from the GGUF block
=====  ====  ==  ======  ==========  ==============  ================================
Q8_0   8     32  128     d fp16      no              d * q
Q4_0   4     32  8       d fp16      no              d * (q - 8)
Q5_0   5     32  16      d fp16      no              d * (q - 16)
Q4_1   4     32  0       d fp16      -m fp16         d * q + m
Q5_1   5     32  0       d fp16      -m fp16         d * q + m
Q4_K   4     32  0       sc u8 x d   mn u8 x dmin    (d * sc) * q - dmin * mn
Q5_K   5     32  0       sc u8 x d   mn u8 x dmin    (d * sc) * q - dmin * mn
Q6_K   6     16  32      sc i8 x d   no              (d * sc) * (q - 32)
=====  ====  ==  ======  ==========  ==============  ================================

Rows need K % 64 == 0; other shapes and types stay on the dequantized path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedlm.utils import huge_page_zeros, release_mapped_pages

_T = GGMLQuantizationType
_ROW_CHUNK_VALUES = 1 << 22  # rows repacked per step: keeps the int temporaries small
TILE_ROWS = 16  # rows per VNNI tile (one 16-lane int32 vector of dot products)


@dataclass
class PackedGGUFWeight:
    """An [n, K] weight in the layout above (all tensors contiguous, on the CPU); T = ceil(n /
    16) row tiles."""

    qs: torch.Tensor  # uint8 [T, K/4, 64] (8 bits) or [T, K/8, 64]
    qh: torch.Tensor | None  # uint8 [T, K/8, 16 * (bits - 4)] for 5/6 bits
    scales: torch.Tensor  # [T, K/G, 16]: fp16, or the K-quants' uint8 / int8 sub-scales
    mins: torch.Tensor | None  # as scales (fp16, or uint8 sub-mins), or None
    bits: int
    group: int
    offset: int
    ggml_type: int
    n: int  # rows (the last tile's padding excluded)
    super_scales: torch.Tensor | None = None  # fp32 [T, K/256, 16]: the K-quants' d
    super_mins: torch.Tensor | None = None  # fp32 [T, K/256, 16]: the K-quants' dmin
    # fp32 [T * 16] (padding rows 0): the one scale of each row, where `scales` repeats it
    # over the row's blocks (per-channel int8, `pack_q8`); the per-channel GEMMs read only this
    channel_scales: torch.Tensor | None = None
    # per-channel int8: the values per activation scale that the per-channel GEMMs are asked
    # for (`kernels.gguf.channel_act_block`), or None: once per token (vLLM's W8A8)
    activation_block: int | None = 128

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.scales.shape[1] * self.group

    @property
    def gemm_act_block(self) -> int:
        """Values per activation scale in the integer GEMM (the GEMV's are always 32): 256 for
        the K-quants (ggml's Q8_K, so a super-block's sub-blocks combine in integers); 128 for
        blocks of 32 where K allows (one float multiply per block of 32 less), else 32."""
        if self.super_scales is not None:
            return 256
        return 128 if self.shape[1] % 128 == 0 else 32

    def nbytes(self) -> int:
        parts = (
            self.qs,
            self.qh,
            self.scales,
            self.mins,
            self.super_scales,
            self.super_mins,
            self.channel_scales,
        )
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def row_values(self, name: str) -> torch.Tensor | None:
        """`scales` or `mins` per row as fp32 [n, K/G]; for K-quants the product with the
        super-block's value, d * sub-scale in fp32 as ggml forms it."""
        v = getattr(self, name)
        if v is None:
            return None
        v = v.float()
        sup = getattr(self, "super_" + name)
        if sup is not None:
            v = sup.repeat_interleave(256 // self.group, dim=1) * v
        return v.transpose(1, 2).reshape(-1, v.shape[1])[: self.n]


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian byte pairs [n, 2m] -> their fp16 values [n, m]."""
    return b.contiguous().view(torch.float16)


def _fp16_as_fp32(b: torch.Tensor) -> torch.Tensor:
    return _fp16(b).float()


def _cat_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: low nibbles are values 0-15, high nibbles 16-31 (Q4_0 style)."""
    return torch.cat((qs & 15, qs >> 4), dim=1)


def _bits_of(b: torch.Tensor, count: int) -> torch.Tensor:
    """[n, count / 8] bytes -> [n, count] of 0/1: bit i of the little-endian bit string."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b[:, :, None] >> shifts) & 1).reshape(b.shape[0], count)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 scale bytes -> (8 scales, 8 mins) as uint8 (ggml's get_scale_min_k4)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), dim=1)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return sc, mn


# Per type: raw blocks [n, type_size] -> (q uint8 [n, values], scale [n, subs], min [n, subs]
# or None, and for K-quants d and dmin fp32 [n, 1], else None): the table above.
def _q8_0(b):
    q = (b[:, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return q, _fp16(b[:, :2]), None, None, None


def _q4_0(b):
    return _cat_nibbles(b[:, 2:18]), _fp16(b[:, :2]), None, None, None


def _q5_0(b):
    q = _cat_nibbles(b[:, 6:22]) | (_bits_of(b[:, 2:6], 32) << 4)
    return q, _fp16(b[:, :2]), None, None, None


def _q4_1(b):
    return _cat_nibbles(b[:, 4:20]), _fp16(b[:, :2]), -_fp16(b[:, 2:4]), None, None


def _q5_1(b):
    q = _cat_nibbles(b[:, 8:24]) | (_bits_of(b[:, 4:8], 32) << 4)
    return q, _fp16(b[:, :2]), -_fp16(b[:, 2:4]), None, None


def _q45_k(b, five: bool):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dm = _fp16_as_fp32(b[:, :4])
    qs = b[:, 48:176] if five else b[:, 16:144]
    chunks = qs.reshape(n, 4, 32)  # chunk c: sub-block 2c (low), 2c + 1 (high nibbles)
    q = torch.stack((chunks & 15, chunks >> 4), dim=2).reshape(n, 8, 32)
    if five:  # bit j of qh[l] is bit 4 of value l of sub-block j
        qh = b[:, 16:48]
        shifts = torch.arange(8, dtype=torch.uint8)
        q = q | (((qh[:, None, :] >> shifts[None, :, None]) & 1) << 4)
    return q.reshape(n, 256), sc, mn, dm[:, :1], dm[:, 1:]


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    low = torch.cat((ql & 15, ql >> 4), dim=2)  # [n, 2, 128]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    high = ((qh[:, :, None, :] >> shifts[None, None, :, None]) & 3).reshape(n, 2, 128)
    q = (low | (high << 4)).reshape(n, 256)
    return q, b[:, 192:208].view(torch.int8), None, _fp16_as_fp32(b[:, 208:210]), None


# type -> (decoder, bits, G, offset)
_TYPES = {
    _T.Q8_0: (_q8_0, 8, 32, 128),
    _T.Q4_0: (_q4_0, 4, 32, 8),
    _T.Q5_0: (_q5_0, 5, 32, 16),
    _T.Q4_1: (_q4_1, 4, 32, 0),
    _T.Q5_1: (_q5_1, 5, 32, 0),
    _T.Q4_K: (lambda b: _q45_k(b, False), 4, 32, 0),
    _T.Q5_K: (lambda b: _q45_k(b, True), 5, 32, 0),
    _T.Q6_K: (_q6_k, 6, 16, 32),
}
PACKABLE_TYPES = frozenset(_TYPES)


def can_pack(ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF tensor of this type and (PyTorch-order) shape keeps its packed form."""
    try:
        t = _T(int(ggml_type))
    except ValueError:
        return False
    return t in _TYPES and len(shape) == 2 and shape[1] % 64 == 0 and shape[0] > 0


def _bit_masks(bit: torch.Tensor) -> torch.Tensor:
    """[..., 64] of 0/1 -> [..., 8] bytes of the little-endian 64-bit mask."""
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    return (bit.reshape(*bit.shape[:-1], 8, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def _tiles(q: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unpacked q [n, K] uint8 (n a multiple of 16) -> (qs, qh) of the tiles."""
    n, k = q.shape
    # [T, K/4, 16 rows, 4 values]: the k-quad vectors
    tiles = n // TILE_ROWS
    quads = q.view(tiles, TILE_ROWS, k // 4, 4).transpose(1, 2).reshape(tiles, k // 4, 64)
    if bits == 8:
        return quads.contiguous(), None
    lo, hi = quads[:, 0::2], quads[:, 1::2]  # k-quads 2s and 2s + 1
    qs = ((lo & 15) | ((hi & 15) << 4)).contiguous()
    if bits == 4:
        return qs, None
    masks = [_bit_masks((half >> (4 + p)) & 1) for p in range(bits - 4) for half in (lo, hi)]
    return qs, torch.cat(masks, dim=-1).contiguous()


def pack_gguf(
    raw: np.ndarray | torch.Tensor,
    ggml_type: int,
    shape: tuple[int, int],
    release_read: bool = False,
) -> PackedGGUFWeight:
    """A GGUF tensor's raw bytes (row-major blocks) -> PackedGGUFWeight of `shape` [N, K].

    `release_read`: `raw` views a read-only file mapping, whose pages are dropped from this
    process as each chunk is decoded (so the file and the packed copy of a large tensor are
    never resident at once); never on anonymous memory, which it would zero."""
    t = _T(int(ggml_type))
    if not can_pack(t, shape):
        raise ValueError(f"{t.name} tensor of shape {tuple(shape)} cannot be packed (K % 64)")
    decode, bits, group, offset = _TYPES[t]
    n, k = shape
    block, type_size = GGML_QUANT_SIZES[t]
    data = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(raw))
    flat = data.reshape(-1).view(torch.uint8)
    # a strided view (a column shard) was copied: its copy is not the mapping's pages
    release_read = release_read and flat.data_ptr() == data.data_ptr()
    data = flat
    if data.numel() != n * k // block * type_size:
        raise ValueError(f"{t.name} tensor {tuple(shape)}: got {data.numel()} bytes")
    blocks = data.view(n, k // block, type_size)
    tiles = -(-n // TILE_ROWS)
    quads = k // 4 if bits == 8 else k // 8
    # huge pages: a decode step streams every weight, and with 4 KiB pages misses the TLB
    qs = huge_page_zeros((tiles, quads, 64), torch.uint8)
    qh = huge_page_zeros((tiles, k // 8, 16 * (bits - 4)), torch.uint8) if bits in (5, 6) else None
    fields: dict[str, torch.Tensor] = {}  # scales, mins, super_scales, super_mins
    step = max(1, _ROW_CHUNK_VALUES // k // TILE_ROWS) * TILE_ROWS
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        chunk = blocks[r0:r1]
        q, *parts = decode(chunk.reshape(-1, type_size))
        rows = -(-(r1 - r0) // TILE_ROWS) * TILE_ROWS  # the last tile padded with zeros
        t0, t1 = r0 // TILE_ROWS, r0 // TILE_ROWS + rows // TILE_ROWS
        qs[t0:t1], h = _tiles(_pad_rows(q.reshape(r1 - r0, k), rows), bits)
        if qh is not None:
            qh[t0:t1] = h
        for name, part in zip(("scales", "mins", "super_scales", "super_mins"), parts, strict=True):
            if part is None:
                continue
            v = _row_tiles(part.reshape(r1 - r0, -1), rows)
            if name not in fields:
                fields[name] = torch.zeros(tiles, *v.shape[1:], dtype=v.dtype)
            fields[name][t0:t1] = v
        if release_read:  # after the last read of this chunk (`q` may view it)
            release_mapped_pages(chunk.data_ptr(), chunk.numel())
    return PackedGGUFWeight(
        qs,
        qh,
        fields["scales"],
        fields.get("mins"),
        bits,
        group,
        offset,
        int(t),
        n,
        fields.get("super_scales"),
        fields.get("super_mins"),
    )


def pack_q8(
    q: torch.Tensor, scale: torch.Tensor, activation_block: int | None = 128
) -> PackedGGUFWeight:
    """Symmetric int8 rows q [N, K] and their scales -> Q8_0's packed layout with fp32 scales:
    the int8 linear methods' weights, computed by the same kernels. `scale`: [N, K/32] (W =
    scale * q per 32-value block) or [N], one per output channel (also kept as
    `channel_scales`, 0 on all-zero rows, with `activation_block`)."""
    n, k = q.shape
    per_channel = scale.dim() == 1
    blocks = scale.float().reshape(n, 1).expand(n, k // 32) if per_channel else scale.float()
    if q.dtype != torch.int8 or tuple(blocks.shape) != (n, k // 32) or k % 64:
        raise ValueError("pack_q8 takes int8 [N, K % 64 == 0] and scales [N] or [N, K/32]")
    tiles = -(-n // TILE_ROWS)
    qs = huge_page_zeros((tiles, k // 4, 64), torch.uint8)
    step = max(1, _ROW_CHUNK_VALUES // k // TILE_ROWS) * TILE_ROWS
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = -(-(r1 - r0) // TILE_ROWS) * TILE_ROWS
        u = (q[r0:r1].to(torch.int16) + 128).to(torch.uint8)
        qs[r0 // TILE_ROWS : r0 // TILE_ROWS + rows // TILE_ROWS] = _tiles(_pad_rows(u, rows), 8)[0]
    packed_scales = _row_tiles(blocks, tiles * TILE_ROWS).contiguous()
    channel = None
    if per_channel:  # an all-zero row's scale is 0 here: the AMX GEMM sums q + 128 in fp32
        # and takes the + 128's share off per row, leaving rounding residue times the scale
        zero_rows = ~q.contiguous().view(torch.int64).any(dim=1)  # 8 quants a lane (6x faster)
        kept = scale.float().reshape(n).masked_fill(zero_rows, 0.0).reshape(n, 1)
        channel = _pad_rows(kept, tiles * TILE_ROWS).reshape(-1)
    return PackedGGUFWeight(
        qs,
        None,
        packed_scales,
        None,
        8,
        32,
        128,
        int(_T.Q8_0),
        n,
        channel_scales=channel,
        activation_block=activation_block if per_channel else 128,
    )


_ROWS_PER_GATHER = 256  # rows decoded per step by `packed_rows` (16 x that many unpacked)


def packed_rows(w: PackedGGUFWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int64 [B]) of a packed weight as fp32 [B, K], exactly
    `dequantize_packed(w)[rows]`, reading only those rows' tiles (an embedding lookup from the
    LM head's weight): 8-bit rows straight from their bytes, narrower ones by decoding each
    row's tile."""
    n, k = w.shape
    tile, lane = rows // TILE_ROWS, rows % TILE_ROWS
    if w.bits == 8:  # each row's own bytes, not its whole tile's (16x the data)
        quads = w.qs.view(-1, k // 4, TILE_ROWS, 4)[tile, :, lane]  # [B, K/4, 4]
        q = quads.reshape(-1, k // w.group, w.group).float().sub_(w.offset)  # exact in fp32
        scales = w.scales[tile, :, lane].float()  # [B, K/G]
        return q.mul_(scales[..., None]).view(-1, k)
    out = torch.empty(rows.shape[0], k)
    tiled = ("qs", "qh", "scales", "mins", "super_scales", "super_mins")
    for r0 in range(0, rows.shape[0], _ROWS_PER_GATHER):
        t = tile[r0 : r0 + _ROWS_PER_GATHER]
        parts = {f: None if getattr(w, f) is None else getattr(w, f)[t] for f in tiled}
        sub = dataclasses.replace(w, **parts, n=t.shape[0] * TILE_ROWS, channel_scales=None)
        decoded = dequantize_packed(sub).view(t.shape[0], TILE_ROWS, k)
        out[r0 : r0 + t.shape[0]] = decoded[torch.arange(t.shape[0]), lane[r0 : r0 + t.shape[0]]]
    return out


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat((x, x.new_zeros(rows - x.shape[0], x.shape[1])))


def _row_tiles(v: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-row values [r, subs] -> [rows / 16, subs, 16] (zero padding rows)."""
    v = _pad_rows(v, rows)
    return v.view(rows // TILE_ROWS, TILE_ROWS, -1).transpose(1, 2)


def unpack_q(w: PackedGGUFWeight) -> torch.Tensor:
    """The unsigned quants q [n, K] uint8 (PyTorch twin of the kernels' unpacking)."""
    n, k = w.shape
    tiles = w.qs.shape[0]
    if w.bits == 8:
        quads = w.qs
    else:
        lo, hi = w.qs & 15, w.qs >> 4
        if w.qh is not None:
            shifts = torch.arange(8, dtype=torch.uint8)
            for p in range(w.bits - 4):
                for h, half in enumerate((lo, hi)):
                    at = 16 * p + 8 * h
                    bit = ((w.qh[..., at : at + 8, None] >> shifts) & 1).reshape(half.shape)
                    half |= bit << (4 + p)
        quads = torch.stack((lo, hi), dim=2).reshape(tiles, k // 4, 64)
    q = quads.view(tiles, k // 4, TILE_ROWS, 4).transpose(1, 2).reshape(tiles * TILE_ROWS, k)
    return q[:n]


def dequantize_packed(
    w: PackedGGUFWeight, rows: slice = slice(None), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W[rows] as `dtype`: fp32 ``(q - offset) * scale - min``, ggml's values bit for bit."""
    q = unpack_q(w)[rows]
    n, k = q.shape
    x = (q.to(torch.int32) - w.offset).float().view(n, k // w.group, w.group)
    x.mul_(w.row_values("scales")[rows][..., None])
    if w.mins is not None:
        x.sub_(w.row_values("mins")[rows][..., None])
    return x.view(n, k).to(dtype)


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 q [M, K], fp32 d [M, K/block]) per block of 32, 128 or 256 values:
    d = amax / 127, q = round-half-even(x * (127 / amax)) -- the kernels' own quantization,
    op for op."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    amax = xb.abs().amax(-1)
    # tensor / tensor: a true fp32 division like C's 127.f / amax (python-scalar / tensor is
    # computed as 127 * (1 / amax) and can round differently)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).to(torch.int8).view(m, k)
    return q, amax / 127.0
