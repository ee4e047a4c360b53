"""The C kernels against their PyTorch paths or fp32 references: greedy argmax, RMSNorm,
SiLU-and-mul, RoPE and the small-batch linears: AMX, AVX-512 BF16 and portable (decode
attention: test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from pagedlm.kernels.cpu import (
    SMALL_BATCH_ROWS,
    argmax_rows,
    block_small_batch_weight,
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
@pytest.mark.parametrize(
    ("head", "rotary_dim"),
    [(16, 16), (16, 8), (64, 64), (128, 64)],  # partial rotary: the rest passes through;
)  # halves of 32 and more: AVX-512's 16-lane loop
def test_rotary_kernel_matches_torch(monkeypatch, dtype, head, rotary_dim) -> None:
    from pagedlm.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(head, rotary_dim, max_position=64, base=10000.0)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, 4 * head + 2 * 2 * head, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (11,), generator=gen)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = qkv.clone().split([4 * head, 2 * head, 2 * head], dim=-1)  # strided rows
        q, k = rope(positions, q, k)
        return q.contiguous(), k.contiguous()

    got, want = run(), _torch_path(monkeypatch, run)
    _close(got[0], want[0])
    _close(got[1], want[1])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_keeps_the_sign_of_zeros(monkeypatch, dtype) -> None:
    """Zeros rotate to the zeros PyTorch gives, sign included (the vector loop negates by a
    sign flip: 0 - x would turn -0 into +0 where cos < 0)."""
    from pagedlm.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(64, 64, max_position=64, base=10000.0)
    positions = torch.arange(40, 64)  # cos < 0 in some lanes

    def run() -> torch.Tensor:
        q = torch.zeros(24, 2 * 64, dtype=dtype)
        q[:, 1::3] = -0.0
        k = torch.zeros(24, 64, dtype=dtype)
        q, k = rope(positions, q, k)
        return torch.cat([q, k], dim=-1)

    got, want = run(), _torch_path(monkeypatch, run)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


needs_fast_linear = pytest.mark.skipif(
    not small_batch_linear_supported(), reason="no AMX/AVX-512 BF16 here: oneDNN serves them"
)
needs_avx512_bf16 = pytest.mark.skipif(
    lib is None or not lib.gemv_bf16_avx512_compiled(), reason="no AVX-512 BF16 here"
)


def _linear_case(rows: int, n: int, k: int, with_bias: bool):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    return x, w, b, want


def _within_one_bf16_step(got: torch.Tensor | None, want: torch.Tensor) -> None:
    """fp32 sums in another order, one rounding to bf16: within one bf16 step of fp32."""
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-8)


@needs_fast_linear
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 48, 49, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_matches_fp32_reference(rows, with_bias) -> None:
    """The fastest path here, on the layout the platform keeps for it."""
    from pagedlm.platforms.cpu import CpuPlatform

    x, w, b, want = _linear_case(rows, 48, 96, with_bias)
    small = CpuPlatform().small_batch_weight(w)
    assert small is not None
    _within_one_bf16_step(small_batch_linear(x, small, b), want)


@needs_avx512_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 64])
@pytest.mark.parametrize("shape", [(16, 2), (48, 96), (80, 34), (96, 896)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_avx512_bf16_linear(rows, shape, with_bias) -> None:
    """Blocked layout [N/16, K/2, 16, 2]: groups of 4 blocks (1-2 rows) and pairs of blocks in
    8-row panels (more rows), odd block counts, K in several L1 chunks of 128 pairs with a
    shorter last one (896), K not a multiple of the 32-wide dense step. Every row sums its k
    pairs in one order, so a batch's rows equal each row computed alone, bit for bit."""
    x, w, b, want = _linear_case(rows, *shape, with_bias)
    blocked = block_small_batch_weight(w)
    assert blocked is not None and blocked.shape == (shape[0] // 16, shape[1] // 2, 16, 2)
    got = small_batch_linear(x, blocked, b)
    _within_one_bf16_step(got, want)
    for i in (0, rows - 1):
        assert torch.equal(got[i : i + 1], small_batch_linear(x[i : i + 1], blocked, b))


@needs_kernels
@pytest.mark.parametrize("isa", ["avx512_bf16", "avx2", "portable"])
@pytest.mark.parametrize(
    "shape", [(1, 37, 100), (3, 96, 896), (16, 130, 64), (5, 8, 33), (2, 20, 7)]
)
def test_dense_small_batch_linear_paths(isa, shape) -> None:
    """The dense-weight loops (tied LM heads; CPUs without AMX/AVX-512 BF16): any N and K."""
    if isa == "avx512_bf16" and not lib.gemv_bf16_avx512_compiled():
        pytest.skip("no AVX-512 BF16 here")
    if isa == "avx2" and not lib.gemv_bf16_avx2_compiled():
        pytest.skip("no AVX2 here")
    x, w, b, want = _linear_case(*shape, with_bias=True)
    _within_one_bf16_step(small_batch_linear(x, w, b, isa=isa), want)


def test_blocked_layout_round_trips() -> None:
    from pagedlm.kernels.cpu import unblock_small_batch_weight

    w = torch.randn(48, 96).bfloat16()
    assert torch.equal(unblock_small_batch_weight(block_small_batch_weight(w)), w)


def test_blocked_layout_needs_whole_blocks() -> None:
    assert block_small_batch_weight(torch.zeros(40, 64, dtype=torch.bfloat16)) is None
    assert block_small_batch_weight(torch.zeros(48, 63, dtype=torch.bfloat16)) is None
    assert block_small_batch_weight(torch.zeros(48, 64)) is None  # fp32


def test_small_batch_linear_declines_what_it_does_not_cover() -> None:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k).bfloat16()

    x = w(4, 96)
    assert small_batch_linear(w(SMALL_BATCH_ROWS + 1, 96), w(48, 96), None) is None  # rows
    assert small_batch_linear(x.float(), w(48, 96).float(), None) is None  # fp32


def test_small_batch_copy_only_while_ram_allows(monkeypatch) -> None:
    """The small-batch copy next to the prepacked one needs a fast kernel and room: a model
    that would take RAM past the limit keeps the prepacked layout alone."""
    from types import SimpleNamespace

    from pagedlm.kernels.cpu import small_batch_linear_isa
    from pagedlm.platforms.cpu import CpuPlatform

    platform = CpuPlatform()
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert platform.small_batch_weight(w.float()) is None
    assert (platform.small_batch_weight(w) is not None) == small_batch_linear_supported()
    assert platform.reads_dense_weight(w) == (small_batch_linear_isa() in ("amx", "avx2"))
    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(total=1 << 20))
    assert platform.small_batch_weight(w) is None
    assert not platform.reads_dense_weight(w)


@needs_kernels
def test_avx2_cpus_run_small_batches_on_the_dense_weight(monkeypatch) -> None:
    """Without AVX-512, oneDNN has no prepacked bf16 layout: a linear keeps its dense weight,
    which the AVX2 kernel reads for decode batches and F.linear for larger ones."""
    if not lib.gemv_bf16_avx2_compiled():
        pytest.skip("no AVX2 here")
    from pagedlm.layers.linear import linear, prepack_weight
    from pagedlm.platforms.cpu import CpuPlatform

    monkeypatch.setattr("pagedlm.kernels.cpu.small_batch_linear_isa", lambda: "avx2")
    monkeypatch.setattr(CpuPlatform, "prepack_linear_weight", lambda self, w: None)
    module = torch.nn.Linear(96, 48, bias=False).bfloat16()
    dense = module.weight.data
    packed = prepack_weight(module)
    assert packed.data_ptr() == module.weight.data_ptr() == dense.data_ptr()  # one copy
    for rows in (2, SMALL_BATCH_ROWS + 3):  # the kernel, then F.linear
        x = torch.randn(rows, 96).bfloat16()
        _within_one_bf16_step(linear(x, module.weight, None, packed), x.float() @ dense.float().T)


@needs_kernels
@pytest.mark.parametrize(
    ("isa", "blocked"), [("avx512_bf16", False), ("avx512_bf16", True), ("avx2", False)]
)
def test_small_batch_linear_takes_only_the_batches_it_wins(monkeypatch, isa, blocked) -> None:
    """Where it chooses, AVX-512 BF16's dense loop (tied LM heads) takes up to
    DENSE_AVX512_BF16_ROWS rows; its blocked kernel and AVX2's up to SMALL_BATCH_ROWS; an
    `isa` asked for is run at any of those. `linear` gives larger batches to the prepacked
    copy, with the same product."""
    from pagedlm.kernels import cpu as kc
    from pagedlm.layers.linear import linear

    compiled = {"avx512_bf16": lib.gemv_bf16_avx512_compiled, "avx2": lib.gemv_bf16_avx2_compiled}
    if not compiled[isa]():
        pytest.skip(f"no {isa} here")
    monkeypatch.setattr("pagedlm.kernels.cpu.small_batch_linear_isa", lambda: isa)
    dense = torch.randn(48, 96).bfloat16()
    w = kc.block_small_batch_weight(dense) if blocked else dense
    limit = kc.DENSE_AVX512_BF16_ROWS if isa == "avx512_bf16" and not blocked else SMALL_BATCH_ROWS
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 96).bfloat16()
        want = x.float() @ dense.float().T
        got = kc.small_batch_linear(x, w, None)
        if rows <= limit:
            _within_one_bf16_step(got, want)
        else:
            assert got is None
        if not blocked and rows <= SMALL_BATCH_ROWS:
            _within_one_bf16_step(kc.small_batch_linear(x, w, None, isa=isa), want)
        _within_one_bf16_step(linear(x, w, None, dense), want)


@needs_kernels
def test_wrappers_reject_tensors_the_c_code_would_misread() -> None:
    """dtype, shape and layout of every pointer argument are checked before the call."""
    from pagedlm.kernels.cpu import rms_norm, rotary_embedding
    from pagedlm.kernels.cpu_attention import paged_decode_attention

    q = torch.randn(2, 4, 64)
    cache = torch.randn(3, 16, 2, 64)
    table = torch.zeros(2, 3, dtype=torch.int64)
    lens = torch.tensor([5, 7])
    with pytest.raises(TypeError, match="block_table must be a 2-D int64"):
        paged_decode_attention(lib, q, cache, cache, table.int(), lens, 0.1, None)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous int64"):
        paged_decode_attention(lib, q, cache, cache, table, lens.int(), 0.1, None)
    with pytest.raises(TypeError, match="unsupported KV cache dtypes"):
        paged_decode_attention(lib, q, cache.bfloat16(), cache, table, lens, 0.1, None)
    with pytest.raises(ValueError, match="one seq_lens entry"):
        paged_decode_attention(lib, q, cache, cache, table, lens[:1], 0.1, None)
    x = torch.randn(3, 32)
    with pytest.raises(TypeError, match="weight must be torch.float32"):
        rms_norm(lib, x, None, torch.ones(32).bfloat16(), 1e-6, 0.0)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(lib, x, None, torch.ones(16), 1e-6, 0.0)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        rms_norm(lib, x, torch.randn(32, 3).t(), torch.ones(32), 1e-6, 0.0)
    cos = torch.randn(10, 8)
    with pytest.raises(TypeError, match="positions must be torch.int64"):
        rotary_embedding(lib, torch.zeros(3, dtype=torch.int32), x, x, cos, cos, 8)
    with pytest.raises(TypeError, match="argmax_rows: logits must be"):
        argmax_rows(lib, torch.zeros(2, 5, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight has shape"):
        small_batch_linear(torch.randn(2, 32).bfloat16(), torch.randn(8, 16).bfloat16(), None)
