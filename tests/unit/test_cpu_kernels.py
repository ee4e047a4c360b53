"""The C kernels against their PyTorch paths or fp32 references: greedy argmax, RMSNorm,
SiLU-and-mul, RoPE and the small-batch AMX linear (decode attention: test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from pagedlm.kernels.cpu import (
    SMALL_BATCH_ROWS,
    argmax_rows,
    cpu_kernels,
    small_batch_linear,
    small_batch_linear_supported,
)
from pagedlm.layers.sampler import greedy_sample

lib = cpu_kernels()
needs_kernels = pytest.mark.skipif(lib is None, reason="no C compiler: PyTorch paths only")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 1024, 1500, 5000])
def test_argmax_rows_matches_torch(dtype, vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen).to(dtype)
    if vocab > 1:
        logits[1, vocab - 1] = logits[1].max() + 1  # maximum in the last element
        logits[2, 0] = logits[2, vocab // 2] = logits[2].max() + 1  # tie: first index wins
        logits[3, vocab // 3] = float("nan")
    logits[4] = float("-inf")
    got = argmax_rows(lib, logits)
    assert got.dtype == torch.long
    assert got.tolist() == logits.argmax(-1).tolist()


@needs_kernels
def test_argmax_rows_takes_non_contiguous_rows() -> None:
    logits = torch.randn(6, 300)[::2, :257]
    assert argmax_rows(lib, logits).tolist() == logits.argmax(-1).tolist()


def test_greedy_sample_falls_back_for_other_dtypes() -> None:
    logits = torch.randn(3, 50).half()
    assert greedy_sample(logits).tolist() == logits.argmax(-1).tolist()


def _torch_path(monkeypatch, fn):
    """Run fn with the C kernels switched off (the layers' PyTorch code)."""
    with monkeypatch.context() as m:
        m.setattr("pagedlm.kernels.cpu.cpu_kernels", lambda: None)
        return fn()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: tight; bf16: at most one bf16 step apart (fp32 sums in another order may round
    the other way), and on all but a handful of elements exactly equal."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (got != want).float().mean() < 0.01


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [72, 96])  # 96: the AVX-512 row path
def test_rms_norm_kernel_matches_torch(monkeypatch, dtype, offset, with_residual, hidden) -> None:
    from pagedlm.layers.layernorm import RMSNorm

    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(hidden, eps=1e-6, offset=offset).to(dtype)
    norm.weight.data.copy_(torch.randn(hidden, generator=gen))
    x = (torch.randn(37, hidden, generator=gen) * 3).to(dtype)
    res = torch.randn(37, hidden, generator=gen).to(dtype) if with_residual else None
    want = _torch_path(monkeypatch, lambda: norm(x, None if res is None else res.clone()))
    got = norm(x, None if res is None else res.clone())
    if with_residual:
        _close(got[0], want[0])
        assert torch.equal(got[1], want[1])  # x + residual, rounded the same way
    else:
        _close(got, want)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 40])  # 40: an AVX-512 body and a scalar tail
def test_silu_and_mul_kernel_matches_torch(monkeypatch, dtype, d) -> None:
    from pagedlm.layers.activation import SiluAndMul

    x = (torch.randn(9, 2 * d, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    x[0, 0], x[0, 1] = 100.0, -100.0  # exp clamping on both sides
    act = SiluAndMul()
    _close(act(x), _torch_path(monkeypatch, lambda: act(x)))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # 8: partial rotary, the rest passes through
def test_rotary_kernel_matches_torch(monkeypatch, dtype, rotary_dim) -> None:
    from pagedlm.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(16, rotary_dim, max_position=64, base=10000.0)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, 4 * 16 + 2 * 2 * 16, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (11,), generator=gen)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = qkv.clone().split([64, 32, 32], dim=-1)  # strided rows, as in the models
        q, k = rope(positions, q, k)
        return q.contiguous(), k.contiguous()

    got, want = run(), _torch_path(monkeypatch, run)
    _close(got[0], want[0])
    _close(got[1], want[1])


needs_amx = pytest.mark.skipif(
    not small_batch_linear_supported(), reason="no AMX here: oneDNN serves small batches"
)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 48, 49, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_matches_fp32_reference(rows, with_bias) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(48, 96, generator=gen).bfloat16()
    b = torch.randn(48, generator=gen).bfloat16() if with_bias else None
    got = small_batch_linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    # fp32 sums in another order, one rounding to bf16: within one bf16 step of the reference
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-8)


def test_small_batch_linear_declines_what_it_does_not_cover() -> None:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k).bfloat16()

    x = w(4, 96)
    assert small_batch_linear(w(SMALL_BATCH_ROWS + 1, 96), w(48, 96), None) is None  # rows
    assert small_batch_linear(x, w(40, 96), None) is None  # N % 16
    assert small_batch_linear(w(4, 80), w(48, 80), None) is None  # K % 32
    assert small_batch_linear(x.float(), w(48, 96).float(), None) is None  # fp32


def test_dense_weight_copy_only_while_ram_allows(monkeypatch) -> None:
    """The dense bf16 copy next to the prepacked one needs AMX and room: a model that would
    take RAM past the limit keeps the prepacked layout alone."""
    from types import SimpleNamespace

    from pagedlm.platforms.cpu import CpuPlatform

    platform = CpuPlatform()
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert not platform.reads_dense_weight(w.float())
    assert platform.reads_dense_weight(w) == small_batch_linear_supported()
    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(total=1 << 20))
    assert not platform.reads_dense_weight(w)
