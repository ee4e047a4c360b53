"""The C greedy-sampling kernel against torch.argmax (first maximal index, NaN, -inf rows)."""

from __future__ import annotations

import pytest
import torch

from pagedlm.kernels.cpu import argmax_rows, cpu_kernels
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
