"""Quantized GGUF matmuls (pagedlm.kernels.gguf) against dequantize-then-matmul.

Oracles, on random blocks of every packable type:
- repacking loses nothing: the packed weight dequantizes (PyTorch twin and C kernel) to
  exactly gguf_quants.dequantize's float32 values;
- the C activation quantizer equals its PyTorch twin bit for bit;
- y = x W^T from the integer kernels equals, in float64, dequant(W) @ dequant(quant(x))^T up
  to fp32 rounding: |err| <= 2^-20 * (|W| @ |xq|^T) (K <= 4096 terms, fp32 eps 2^-24);
- against the unquantized activations the only extra error is quantizing x: per element at
  most half a step d / 2 of its block (32 values; 256 in the GEMM on K-quants), so
  |y - W x| <= sum_k |W_nk| d(k) / 2 + the above.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedlm.kernels import gguf as kg
from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.kernels.gguf_pack import (
    PACKABLE_TYPES,
    can_pack,
    dequantize_packed,
    pack_gguf,
    packed_rows,
    quantize_activations,
)
from pagedlm.kernels.gguf_quants import dequantize
from tests.proc_maps import HAS_SMAPS, resident_kb
from tests.unit.test_gguf_quants import FP16_FIELDS, random_blocks

T = GGMLQuantizationType
TYPES = sorted(PACKABLE_TYPES, key=int)
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler")
ISAS = ["portable"] + ([kg.gguf_isa()] if kg.gguf_isa() in ("avx512_vnni", "avx2") else [])


def _raw(t: GGMLQuantizationType, n: int, k: int, seed: int, moderate: bool) -> np.ndarray:
    """Random blocks; `moderate`: fp16 scale fields ~0.01 (matmul tests), else any finite."""
    block = GGML_QUANT_SIZES[t][0]
    raw = random_blocks(t, n * k // block, seed)
    if moderate:
        rng = np.random.default_rng(seed + 1)
        for off in FP16_FIELDS[t]:
            vals = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
            raw[:, off : off + 2] = vals.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_packed_weight_dequantizes_to_ggml_values_exactly(t) -> None:
    n, k = 24, 512
    raw = _raw(t, n, k, int(t), moderate=False)
    want = dequantize(raw, t, (n, k))
    w = pack_gguf(raw, t, (n, k))
    assert w.shape == (n, k)
    assert torch.equal(dequantize_packed(w).view(torch.int32), want.view(torch.int32))
    if cpu_kernels() is not None:
        got = kg.gguf_dequantize_rows(w, 3, 20, torch.float32)
        assert torch.equal(got.view(torch.int32), want[3:20].view(torch.int32))
        got16 = kg.gguf_dequantize_rows(w, 0, n, torch.bfloat16)
        assert torch.equal(got16, want.bfloat16())
    # embedding lookups from a packed head: any rows, repeated, across and within tiles
    ids = torch.tensor([23, 0, 5, 5, 16, 17, 2])
    assert torch.equal(packed_rows(w, ids).view(torch.int32), want[ids].view(torch.int32))


@pytest.mark.skipif(not HAS_SMAPS, reason="reads Linux's smaps")
def test_packing_a_mapped_tensor_drops_its_pages(tmp_path) -> None:
    """release_read: the file's pages leave the process chunk by chunk as they are packed
    (the packed copy equals packing the same bytes from anonymous memory)."""
    t, n, k = T.Q8_0, 2048, 4096  # 8.5 MB: several of the packer's row chunks
    raw = _raw(t, n, k, 0, moderate=False)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = torch.from_numpy(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")))
    assert resident_kb(path)[1] == 0
    w = pack_gguf(mapped, t, (n, k), release_read=True)
    assert resident_kb(path)[1] <= 64  # at most the fault-around of the last read
    assert torch.equal(w.qs, pack_gguf(raw, t, (n, k)).qs)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_packed_weight_is_no_larger_than_its_gguf_blocks(t) -> None:
    """Scales stay as the blocks hold them (fp16, or 8-bit sub-scales under the K-quants'
    super-block scale, kept in fp32: at most 6% more than ggml's fp16 d/dmin)."""
    n, k = 32, 512  # whole tiles: no padding rows
    raw = _raw(t, n, k, int(t), moderate=True)
    assert pack_gguf(raw, t, (n, k)).nbytes() <= raw.nbytes * 1.06


def test_can_pack_rules() -> None:
    assert can_pack(T.Q4_K, (16, 256)) and can_pack(T.Q8_0, (3, 64))
    assert not can_pack(T.Q8_0, (3, 96))  # K % 64
    assert not can_pack(T.Q2_K, (16, 256))  # type without a packed kernel
    assert not can_pack(T.F16, (16, 256))
    assert not can_pack(T.Q8_0, (64,))  # not a matrix
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_gguf(np.zeros(3 * 34 * 3, np.uint8), T.Q8_0, (3, 96))


@needs_kernels
@pytest.mark.parametrize("block", [32, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(12))
def test_activation_quantizer_matches_torch_twin(dtype, seed, block) -> None:
    """Bit for bit, ties included (x = amax / 2 gives exactly 63.5: half to even)."""
    x = (torch.randn(5, 512, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    x[3, 64:66] = torch.tensor([6.53125, -3.265625])
    x[3, 256 + 64 : 256 + 66] = torch.tensor([6.53125, -3.265625])
    x[1, :block] = 0  # an all-zero block: d = 0, q = 0
    x[2, 40] = 1e4  # one large value in a block
    q, d = kg.quantize_rows_q8(x, block)
    qt, dt = quantize_activations(x, block)
    assert torch.equal(q, qt) and torch.equal(d, dt)
    assert d[1, 0] == 0 and (q[1, :block] == 0).all()


def _case(t: GGMLQuantizationType, m: int, n: int, k: int):
    w = pack_gguf(_raw(t, n, k, int(t) + m, moderate=True), t, (n, k))
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * 2
    x[0, :32] = 0
    bias = torch.randn(n, generator=gen)
    return w, x, bias


def _check_against_dequantized(got, w, x, bias, block: int = 32) -> None:
    """got = x W^T + bias within the bounds of the module docstring, the activations quantized
    in blocks of `block` values."""
    m, k = x.shape
    wd = dequantize_packed(w).double()
    q, d = quantize_activations(x, block)
    xq = (q.double().view(m, k // block, block) * d.double()[..., None]).view(m, k)
    want = xq @ wd.T + bias.double()
    fp32_bound = (xq.abs() @ wd.abs().T) * 2**-20 + 1e-6
    assert got.dtype == torch.float32 and got.shape == (m, w.shape[0])
    assert ((got.double() - want).abs() <= fp32_bound).all()
    # against unquantized activations: half a quantization step per element, at most
    step = d.double().repeat_interleave(block, dim=1) / 2  # [m, k]
    act_bound = step @ wd.abs().T + fp32_bound
    exact = x.double() @ wd.T + bias.double()
    assert ((got.double() - exact).abs() <= act_bound).all()


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 9, 17])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_quantized_gemv_equals_dequantized_matmul(t, m, isa) -> None:
    w, x, bias = _case(t, m, 40, 768)
    _check_against_dequantized(kg.gguf_gemv(x, w, bias, isa=isa), w, x, bias)


needs_gemm = pytest.mark.skipif(
    cpu_kernels() is None or not cpu_kernels().gguf_gemm_compiled(), reason="no AVX-512 VNNI"
)


@needs_gemm
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 40, 768),
        (6, 32, 256),
        (7, 72, 512),
        (9, 17, 768),
        (64, 100, 1280),
        (300, 33, 256),
        (1101, 40, 1536),
    ],
)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_quantized_gemm_equals_dequantized_matmul(t, m, n, k) -> None:
    """Every microkernel height (M mod 6), partial column tiles, K-quants at K % 256 == 0;
    1101 rows: threads split the rows, each in several L2-sized blocks."""
    w, x, bias = _case(t, m, n, k)
    _check_against_dequantized(kg.gguf_gemm(x, w, bias), w, x, bias, w.gemm_act_block)


@needs_gemm
@pytest.mark.parametrize("t", [T.Q4_0, T.Q5_0, T.Q8_0, T.Q5_1], ids=lambda t: t.name)
def test_quantized_gemm_k_not_multiple_of_128(t) -> None:
    """Blocks of 32 take activations in blocks of 128 where K allows, else of 32 as the GEMV."""
    w, x, bias = _case(t, 11, 50, 320)
    assert w.gemm_act_block == 32 and _case(t, 1, 8, 384)[0].gemm_act_block == 128
    _check_against_dequantized(kg.gguf_gemm(x, w, None), w, x, torch.zeros(50))
    # same activation quantization, same exact integer sums: GEMV and GEMM agree closely
    torch.testing.assert_close(kg.gguf_gemm(x, w, bias), kg.gguf_gemv(x, w, bias))


@needs_gemm
def test_quantized_gemm_bf16_rounds_once() -> None:
    w, x, bias = _case(T.Q5_0, 13, 48, 256)
    xb, bb = x.bfloat16(), bias.bfloat16()
    got = kg.gguf_gemm(xb, w, bb)
    want = kg.gguf_gemm(xb.float(), w, bb.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-8)


@needs_kernels
@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_quantized_gemv_bf16_rounds_once(t) -> None:
    """bf16 in and out: the fp32 result of the same bf16 activations, rounded to bf16."""
    w, x, bias = _case(t, 3, 32, 256)
    xb, bb = x.bfloat16(), bias.bfloat16()
    got = kg.gguf_gemv(xb, w, bb)
    want = kg.gguf_gemv(xb.float(), w, bb.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-8)


@needs_kernels
def test_kernel_boundary_rejects_wrong_dtypes_and_shapes() -> None:
    w, x, bias = _case(T.Q5_0, 2, 16, 128)
    with pytest.raises(TypeError, match="scales must be torch.float32 or torch.float16"):
        w.scales = w.scales.double()
        kg.gguf_gemv(x, w, None)
    w, x, bias = _case(T.Q5_0, 2, 16, 128)
    with pytest.raises(TypeError, match="qs must be torch.uint8"):
        w.qs = w.qs.to(torch.int32)
        kg.gguf_gemv(x, w, None)
    w, x, bias = _case(T.Q5_0, 2, 16, 128)
    with pytest.raises(ValueError, match="x has shape"):
        kg.gguf_gemv(x[:, :64], w, None)
    with pytest.raises(ValueError, match="bias has shape"):
        kg.gguf_gemv(x, w, bias[:8])
    with pytest.raises(TypeError, match="bias must be torch.float32"):
        kg.gguf_gemv(x, w, bias.bfloat16())


@needs_kernels
def test_gguf_linear_fallbacks_agree(monkeypatch) -> None:
    """Past GEMV_ROWS rows: the integer GEMM where AVX-512 VNNI is compiled in, the AVX2 GEMV
    on AVX2 (activations per 32 values, as in decode); where neither runs, the prefill path
    dequantizes tiles for a float GEMM (exact weights, so the dequantized matmul itself, not
    the int8-activation oracle), and without C kernels the PyTorch twin does: both equal the
    dequantized matmul."""
    from pagedlm.layers.quantization import gguf as method

    w, x, bias = _case(T.Q4_K, 40, 48, 256)
    want = x.double() @ dequantize_packed(w).double().T + bias.double()
    if cpu_kernels().gguf_gemm_compiled():
        _check_against_dequantized(method.gguf_linear(x, w, bias), w, x, bias, w.gemm_act_block)
    elif kg.gguf_isa() == "avx2":
        assert method.takes_gemv(x.shape[0])
        _check_against_dequantized(method.gguf_linear(x, w, bias), w, x, bias)
    else:
        assert kg.gguf_gemm(x, w, bias) is None  # no integer GEMM: the caller dequantizes
        got = method.gguf_linear(x, w, bias).double()
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-5)
    monkeypatch.setattr(method, "takes_gemv", lambda rows: False)  # no integer kernel runs
    monkeypatch.setattr(method.gguf_kernels, "gguf_gemm", lambda *a: None)
    torch.testing.assert_close(method.gguf_linear(x, w, bias).double(), want, atol=1e-3, rtol=1e-5)
    monkeypatch.setattr(method.gguf_kernels, "gguf_dequantize_rows", lambda *a: None)
    torch.testing.assert_close(method.gguf_linear(x, w, bias).double(), want, atol=1e-3, rtol=1e-5)


@needs_gemm
def test_gemm_boundary_rejects_wrong_dtypes_and_shapes() -> None:
    w, x, bias = _case(T.Q4_K, 7, 16, 256)
    kg.gguf_gemm(x, w, bias)  # checked once, then cached on w: a replaced tensor is re-checked
    w.mins = torch.zeros(1, 8, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="mins must be torch.uint8"):
        kg.gguf_gemm(x, w, bias)
    w, x, bias = _case(T.Q6_K, 7, 16, 256)
    w.super_scales = None  # int8 sub-scales mean nothing without the super-block's d
    with pytest.raises(ValueError, match="need super_scales"):
        kg.gguf_gemm(x, w, bias)
    w, x, bias = _case(T.Q6_K, 7, 16, 256)
    with pytest.raises(ValueError, match="x has shape"):
        kg.gguf_gemm(x[:, :128], w, None)
    with pytest.raises(TypeError, match="bias must be torch.float32"):
        kg.gguf_gemm(x, w, bias.bfloat16())
    with pytest.raises(ValueError, match="bias has shape"):
        kg.gguf_gemm(x, w, bias[:8])
