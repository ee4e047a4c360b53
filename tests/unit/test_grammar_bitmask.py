"""Grammar bitmask plumbing: row selection, unpacking, masking against xgrammar's own kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlm.layers.sampler import Sampler, SamplingMetadata
from pagedlm.structured_output import GrammarOutput
from pagedlm.structured_output.bitmask import (
    apply_grammar_bitmask,
    grammar_rows,
    unpack_bitmask,
)


def _random_bitmask(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**31), 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int64).astype(
        np.int32
    )


def test_unpack_matches_bit_definition() -> None:
    vocab = 70  # not a multiple of 32: the last word's high bits are ignored
    bitmask = _random_bitmask(3, vocab)
    allowed = unpack_bitmask(torch.from_numpy(bitmask), vocab)
    expected = np.array(
        [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)],
        dtype=bool,
    )
    assert allowed.shape == (3, vocab)
    assert np.array_equal(allowed.numpy(), expected)
    # a model vocabulary wider than the bitmask: the extra tokens are not allowed
    wide = unpack_bitmask(torch.from_numpy(bitmask), 100)
    assert not wide[:, 96:].any() and torch.equal(wide[:, :vocab], allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_xgrammar(dtype) -> None:
    xgr = pytest.importorskip("xgrammar")
    vocab = 1000
    logits = torch.randn(4, vocab).to(dtype)
    bitmask = _random_bitmask(4, vocab, seed=1)  # xgrammar indexes logits and bitmask alike
    ours = apply_grammar_bitmask(logits.clone(), [1, 3], torch.from_numpy(bitmask[[1, 3]]))
    theirs = logits.float().clone()
    xgr.apply_token_bitmask_inplace(
        theirs, torch.from_numpy(bitmask), indices=[1, 3], backend="torch_native"
    )
    assert torch.equal(ours.float(), theirs)
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])


def test_grammar_rows_follow_the_sampled_batch() -> None:
    bitmask = _random_bitmask(3, 64)
    output = GrammarOutput(["a", "b", "c"], bitmask)
    rows, picked = grammar_rows(output, ["c", "x", "a"])
    assert rows == [2, 0]  # "a" samples in row 2, "c" in row 0; "b" is not sampled here
    assert np.array_equal(picked.numpy(), bitmask[[0, 2]])
    assert grammar_rows(output, ["x"]) is None and grammar_rows(None, ["a"]) is None


def test_sampler_masks_every_path() -> None:
    """Greedy fast path, greedy with logprobs and random rows all obey the bitmask."""
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(3, vocab)
    allowed_ids = [5, 17, 40]
    words = np.zeros((1, 2), dtype=np.int32)
    for t in allowed_ids:
        words[0, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(2**31))
    bitmask = torch.from_numpy(np.repeat(words, 3, axis=0))
    sampler = Sampler()
    cases = [
        SamplingMetadata(temperature=torch.zeros(3), all_greedy=True),
        SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, max_num_logprobs=2),
        SamplingMetadata(temperature=torch.ones(3), all_greedy=False),
    ]
    for md in cases:
        md.grammar_rows, md.grammar_bitmask = [0, 1, 2], bitmask
        for _ in range(5):
            out = sampler(logits.clone(), md)
            assert set(out.sampled_token_ids.tolist()) <= set(allowed_ids)
        if md.all_greedy:
            expected = [allowed_ids[int(logits[r, allowed_ids].argmax())] for r in range(3)]
            assert out.sampled_token_ids.tolist() == expected
