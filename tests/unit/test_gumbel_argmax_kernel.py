"""The C random-row sampler (`gumbel_argmax_rows`) against a NumPy model of its noise: the same
SplitMix64 counter hash and lane order, logs in float64. Distributions through the Sampler are
checked in test_sampler.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlm.kernels.cpu import cpu_kernels, gumbel_argmax_rows

lib = cpu_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: PyTorch paths only")

GAMMA = np.uint64(0x9E3779B97F4A7C15)


def mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def reference_scores(logits: torch.Tensor, seed: int, scale: torch.Tensor) -> np.ndarray:
    """logits * scale - log(-log U) per element, U as sampling.c draws it, in float64."""
    rows, vocab = logits.shape
    with np.errstate(over="ignore"):
        keys = mix64(np.uint64(seed) + (np.arange(1, rows + 1, dtype=np.uint64) * GAMMA))
        pairs = np.arange(vocab, dtype=np.uint64) // np.uint64(2) + np.uint64(1)
        z = mix64(keys[:, None] + pairs[None, :] * GAMMA)
    odd = (np.arange(vocab) % 2).astype(bool)[None, :]
    half = np.where(odd, z >> np.uint64(32), z & np.uint64(0xFFFFFFFF))
    u = ((half >> np.uint64(9)).astype(np.float64) + 0.5) * 2.0**-23
    return (logits.double() * scale.double()[:, None]).numpy() - np.log(-np.log(u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [16, 1000, 37])  # vector body only, body + tail, mostly tail
def test_matches_the_reference_hash(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(41, vocab, generator=gen) * 3).to(dtype)
    scale = torch.rand(41, generator=gen) + 0.5  # 1 / temperature per row
    seed = 0x1234_5678_9ABC_DEF0
    scores = reference_scores(logits, seed, scale)
    got = gumbel_argmax_rows(lib, logits, seed, scale).numpy()
    top2 = np.sort(scores, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4  # the C logs are ~1e-7 off: skip near-ties
    assert clear.sum() > 35
    np.testing.assert_array_equal(got[clear], scores.argmax(1)[clear])


def test_masked_tokens_never_win_and_rows_are_independent() -> None:
    logits = torch.full((64, 100), float("-inf"))
    logits[:, [3, 50, 97]] = 0.0  # equally likely: identical rows must not draw alike
    logits[-1] = float("-inf")  # nothing allowed: index 0, as the race's argmax gives
    ids = gumbel_argmax_rows(lib, logits, 7)
    assert set(ids[:-1].tolist()) == {3, 50, 97}
    assert ids[-1] == 0
    assert torch.equal(ids, gumbel_argmax_rows(lib, logits, 7))  # the seed fixes the draw
    assert not torch.equal(ids, gumbel_argmax_rows(lib, logits, 8))


def test_no_uniform_rounds_to_one() -> None:
    """A U of 1 would make E = 0 and its token win at any logit: one in 2^24 values did (24-bit
    uniforms, (k + 0.5) / 2^24 rounding up), ~0.9% of rows at a 152k vocabulary. Every other
    token sits 60 below token 0, past the largest Gumbel noise (~16.6)."""
    logits = torch.full((64, 151936), -60.0, dtype=torch.bfloat16)
    logits[:, 0] = 0.0
    for seed in range(20):
        assert (gumbel_argmax_rows(lib, logits, seed) == 0).all(), seed


def test_frequencies_follow_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2, -0.5, 3.0, -10.0] * 3)
    rows = logits.expand(60000, logits.numel()).contiguous()  # 33 = 2 vectors + a tail of 1
    counts = torch.bincount(gumbel_argmax_rows(lib, rows, 11), minlength=logits.numel())
    expected = logits.double().softmax(0) * rows.shape[0]
    sd = (expected * (1 - expected / rows.shape[0])).sqrt()
    assert ((counts.double() - expected).abs() <= 5 * sd + 1).all(), (counts, expected)
