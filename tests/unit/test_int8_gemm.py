"""The int8 layout (`pack_q8`) under every kernel: the per-channel GEMMs (AMX-INT8 and AVX-512
VNNI, activations per `channel_act_block` values; each one this CPU runs), the blocks-of-32
VNNI GEMM and the GEMV, each against its PyTorch twin (int8 activations dequantized, times the
dequantized weight) within fp32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedlm.kernels import gguf as kg
from pagedlm.kernels.cpu import cpu_kernels, silu_and_mul
from pagedlm.kernels.gguf_pack import dequantize_packed, pack_q8, quantize_activations
from pagedlm.layers.quantization.int8 import quantize_per_channel

_LIB = cpu_kernels()
# the per-channel GEMMs this CPU runs: each is tested, whichever `gemm_args` picks
CHANNEL_GEMMS = [
    fn
    for fn, runs in (
        ("int8_gemm_amx", "int8_gemm_amx_supported"),
        ("int8_gemm_vnni", "int8_gemm_vnni_compiled"),
    )
    if _LIB is not None and getattr(_LIB, runs)()
]
each_channel_gemm = pytest.mark.parametrize(
    "fn", CHANNEL_GEMMS or [pytest.param(None, marks=pytest.mark.skip("no per-channel GEMM"))]
)
needs_vnni = pytest.mark.skipif(
    cpu_kernels() is None or not cpu_kernels().gguf_gemm_compiled(), reason="no AVX-512 VNNI"
)


def _case(m: int, n: int, k: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(m * 7 + n)
    w = torch.randn(n, k, generator=gen)
    w[1] = 0  # an all-zero channel
    q, scale = quantize_per_channel(w)
    q[2, :7] = -128  # compressed-tensors checkpoints may hold it (AVX2 flips signs around it)
    x = torch.randn(m, k, generator=gen) * 2
    x[:, 5] *= 40  # an outlier channel, as LLM activations have
    x[0, :64] = 0
    return pack_q8(q, scale), q, scale, x.to(dtype), torch.randn(n, generator=gen).to(dtype)


def _check(got, q, scale, x, bias, block: int, stored_quants: bool = False) -> None:
    """`stored_quants`: the kernel sums in fp32 the products with the weights as stored, q +
    128, and subtracts the + 128's share once per row (AMX, blocks up to 512 values), so its
    rounding scales with |q| + 128 rather than |q|."""
    m, k = x.shape
    aq, d = quantize_activations(x, block)
    xq = (aq.double().view(m, k // block, block) * d.double()[..., None]).view(m, k)
    wd = q.double() * scale.double()[:, None]
    want = xq @ wd.T + bias.double()
    summed = (q.double().abs() + 128) * scale.double()[:, None] if stored_quants else wd.abs()
    bound = (xq.abs() @ summed.T) * 2**-20 + 1e-6
    if x.dtype == torch.bfloat16:  # one rounding of the fp32 result to bf16
        bound = bound + want.abs() * 2**-8
    assert got.dtype == x.dtype and got.shape == (m, q.shape[0])
    assert ((got.double() - want).abs() <= bound).all()


def _channel_product(fn, x, packed, bias, out=None, silu_and_mul=False) -> torch.Tensor:
    """The product by per-channel GEMM `fn` with the arguments `gemm_args` checks (the same
    for both), which picks the first of CHANNEL_GEMMS."""
    y, picked, args = kg.gemm_args(x, packed, bias, out=out, silu_and_mul=silu_and_mul)
    assert picked == CHANNEL_GEMMS[0] == kg.channel_gemm(packed)
    assert getattr(_LIB, fn)(*args) == 1
    return y


def test_pack_q8_holds_the_quants_and_scales_exactly() -> None:
    packed, q, scale, *_ = _case(3, 40, 128, torch.float32)
    assert torch.equal(dequantize_packed(packed), q.float() * scale[:, None])
    kept = scale.clone()
    kept[1] = 0  # the all-zero row's scale is 0 for the AMX GEMM
    assert torch.equal(packed.channel_scales[:40], kept) and not packed.channel_scales[40:].any()
    blocks = pack_q8(q, scale[:, None].expand(40, 4))  # per-block scales: no channel scales
    assert blocks.channel_scales is None and torch.equal(blocks.qs, packed.qs)
    with pytest.raises(ValueError, match="pack_q8 takes"):
        pack_q8(q[:, :96], scale)


@each_channel_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k",
    [(5, 40, 64), (16, 32, 128), (17, 33, 256), (37, 100, 1280), (300, 72, 384), (64, 16, 896)],
)
def test_channel_gemm_equals_its_twin(fn, m, n, k, dtype) -> None:
    """Row tails (16-row tiles, 8-row panels), column tails (one or two weight tiles of a
    pair, partial last tile), K in blocks of 64 (K % 128 != 0) and of 128; `gguf_gemm` runs
    the first of CHANNEL_GEMMS."""
    packed, q, scale, x, bias = _case(m, n, k, dtype)
    got = _channel_product(fn, x, packed, bias)
    _check(got, q, scale, x, bias, kg.channel_act_block(k), True)
    if fn == CHANNEL_GEMMS[0]:
        assert torch.equal(kg.gguf_gemm(x, packed, bias), got)


@each_channel_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k", [(45, 40, 1344), (70, 33, 2048), (33, 48, 896), (300, 48, 896), (1100, 40, 1344)]
)
def test_channel_gemm_per_token(fn, m, n, k, dtype) -> None:
    """Activations per token: K in 512-value chunks with the int32 sums carried between them
    (1344 and 896: a shorter last chunk; 2048: four whole ones); with enough row groups that
    the next chunk's weights are prefetched across them (300, 1100), and in two row blocks
    (1100 x 1344: 1.4 MiB of quants)."""
    packed, q, scale, x, bias = _case(m, n, k, dtype)
    per_token = pack_q8(q, scale, activation_block=None)
    assert per_token.activation_block is None and packed.activation_block == 128
    assert kg.channel_act_block(k, None) == k
    _check(_channel_product(fn, x, per_token, bias), q, scale, x, bias, k)


@each_channel_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "block"), [(40, 48, 1280, 256), (33, 40, 2048, 512)])
def test_channel_gemm_coarser_blocks(fn, m, n, k, block, dtype) -> None:
    """A layer's coarser block (down's 256; 512, where the int32 sums of the weights as stored
    come closest to fp32's 2^24) against the twin at that block; the same output checked at
    128 fails, so the test tells the block sizes apart."""
    packed, q, scale, x, bias = _case(m, n, k, dtype)
    coarse = pack_q8(q, scale, activation_block=block)
    assert kg.channel_act_block(k, coarse.activation_block) == block
    got = _channel_product(fn, x, coarse, bias)
    _check(got, q, scale, x, bias, block, True)
    with pytest.raises(AssertionError):
        _check(got, q, scale, x, bias, 128, True)


def test_channel_act_block_falls_back_to_a_divisor_of_k() -> None:
    assert [kg.channel_act_block(k, 256) for k in (4864, 896, 960)] == [256, 128, 64]
    assert kg.channel_act_block(1600, 100) == 64  # not a whole number of the kernel's k-steps
    assert kg.channel_act_block(896, None) == 896


@pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler")
@pytest.mark.parametrize("isa", ["portable"] + (["avx2"] if kg.gguf_isa() == "avx2" else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_gemv_on_the_int8_layout(m, dtype, isa) -> None:
    """The portable GEMV and AVX2's (which serves every batch there): fp32 per-channel scales,
    an all-zero channel, quants of -128, an outlier activation channel, bf16 rounding; and the
    dequantized rows the float fallback multiplies are exactly the twin's."""
    packed, q, scale, x, bias = _case(m, 48, 384, dtype)
    _check(kg.gguf_gemv(x, packed, bias, isa=isa), q, scale, x, bias, 32)
    got = kg.gguf_dequantize_rows(packed, 3, 40, torch.float32)
    assert torch.equal(got, dequantize_packed(packed)[3:40])


@needs_vnni
@pytest.mark.parametrize("m", [1, 3, 9, 40])  # GEMV, then the blocks-of-32 VNNI GEMM
def test_vnni_kernels_on_the_int8_layout(m) -> None:
    packed, q, scale, x, bias = _case(m, 48, 384, torch.float32)
    if m <= 4:
        _check(kg.gguf_gemv(x, packed, bias, isa="portable"), q, scale, x, bias, 32)
        got, block = kg.gguf_gemv(x, packed, bias), 32
    else:
        got, block = kg.gguf_gemm(x, packed, bias, channel=False), packed.gemm_act_block
    _check(got, q, scale, x, bias, block)


@each_channel_gemm
def test_channel_gemm_writes_into_columns_of_a_wider_output(fn) -> None:
    """The decode plan's use: y is a column slice of the fused output (rows ldy apart)."""
    packed, q, scale, x, bias = _case(9, 40, 128, torch.bfloat16)
    out = torch.full((9, 100), 7.0, dtype=torch.bfloat16)
    _channel_product(fn, x, packed, bias, out=out[:, 30:70])
    _check(out[:, 30:70], q, scale, x, bias, kg.channel_act_block(128), True)
    assert (out[:, :30] == 7).all() and (out[:, 70:] == 7).all()


@each_channel_gemm
@pytest.mark.parametrize(
    ("m", "n", "dtype", "columns"),
    [
        (1100, 2048, torch.bfloat16, None),
        (600, 1776, torch.float32, None),  # a last pair of one tile: masked stores
        (1100, 2016, torch.bfloat16, (64, 2080)),  # rows 64-byte aligned within a wider y
        (1100, 2016, torch.bfloat16, (2, 2018)),  # not aligned: plain stores
    ],
)
def test_channel_gemm_outputs_past_the_l2s(fn, m, n, dtype, columns) -> None:
    """Outputs of 4 MiB and more go by non-temporal stores where y's rows are 64-byte aligned
    (whole pairs' rows; the rest as plain stores), written around any columns outside y."""
    packed, q, scale, x, bias = _case(m, n, 128, dtype)
    if columns is None:
        got = _channel_product(fn, x, packed, bias)
    else:
        out = torch.full((m, n + 128), 7.0, dtype=dtype)  # rows 4288 bytes apart
        _channel_product(fn, x, packed, bias, out=out[:, columns[0] : columns[1]])
        assert (out[:, : columns[0]] == 7).all() and (out[:, columns[1] :] == 7).all()
        got = out[:, columns[0] : columns[1]]
    assert got.numel() * got.element_size() >= 4 << 20
    _check(got, q, scale, x, bias, kg.channel_act_block(128), True)


@each_channel_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "block", "bias"),
    [
        (37, 128, 896, None, True),  # per token, K in a 512- and a 384-value chunk
        (70, 192, 1344, None, False),  # per token in 512-value chunks
        (45, 64, 512, 128, True),  # per 128
        (1500, 2048, 256, 128, False),  # y past 4 MiB: streamed
        (1100, 128, 1344, None, True),  # two row blocks, gate -> up -> next gate prefetched
    ],
)
def test_channel_gemm_fuses_silu_and_mul(fn, m, n, k, block, bias, dtype) -> None:
    """The fused form is bit for bit the GEMM's y ([gate | up]) through silu_and_mul: each
    gate pair's sums, rounded as y would be, wait for the up pair N / 2 columns on."""
    packed, q, scale, x, b = _case(m, n, k, dtype)
    packed = pack_q8(q, scale, activation_block=block)
    b = b if bias else None
    y = _channel_product(fn, x, packed, b)
    got = _channel_product(fn, x, packed, b, silu_and_mul=True)
    assert got.shape == (m, n // 2) and torch.equal(got, silu_and_mul(_LIB, y))
    if fn == CHANNEL_GEMMS[0]:
        assert torch.equal(kg.int8_gemm_silu_and_mul(x, packed, b), got)
    gate, up = y.float().chunk(2, dim=-1)  # and that is silu(gate) * up
    torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=2**-7, atol=1e-5)


@each_channel_gemm
def test_channel_gemm_refuses_to_fuse_odd_halves(fn) -> None:
    packed, _, _, x, _ = _case(9, 96, 128, torch.float32)  # halves of 48: not whole pairs
    assert kg.int8_gemm_silu_and_mul(x, packed, None) is None
    with pytest.raises(ValueError, match="silu_and_mul needs"):
        kg.gemm_args(x, packed, None, silu_and_mul=True)
    _, _, args = kg.gemm_args(x, packed, None)
    assert getattr(_LIB, fn)(*args[:-2], 1, args[-1]) == 0  # the C function refuses it too
