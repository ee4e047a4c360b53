"""Sampler: distributions (temperature, top-k, top-p, min-p), greedy and seeded rows, logits
processors and penalties on metadata built from real Requests, and gather_logprobs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from pagedlm.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k_top_p,
    gather_logprobs,
)
from pagedlm.sampling_params import SamplingParams
from pagedlm.worker.input_batch import CachedRequestState, InputBatch
from pagedlm.worker.sampling_metadata import build_sampling_metadata

try:  # pragma: no cover - depends on the environment
    from scipy.stats import chi2 as _scipy_chi2
except ImportError:  # pragma: no cover
    _scipy_chi2 = None

CPU = torch.device("cpu")
NUM_DRAWS = 20_000
# Chi-square tests reject at p < 1e-6: with fixed seeds a correct sampler passes, while a wrong
# distribution (e.g. unscaled min_p, top-p without the boundary token) is off by far more.
_CHI2_ALPHA = 1e-6
_Z_ALPHA = 4.753  # standard-normal upper 1e-6 quantile

# 12 distinct logits, well spread, so every kept token has an expected count of >= 5.
LOGITS_12 = [2.0, 1.6, 1.1, 0.9, 0.5, 0.2, -0.1, -0.4, -0.8, -1.3, -2.0, -3.0]
# Probabilities that make top-p boundaries easy to reason about (they sum to 1).
PROBS_8 = [0.35, 0.25, 0.15, 0.10, 0.06, 0.04, 0.03, 0.02]
LOGITS_8 = [math.log(p) for p in PROBS_8]


# --------------------------------------------------------------------------- helpers


def make_request(
    params: SamplingParams,
    prompt: list[int] | tuple[int, ...] = (1, 2, 3),
    output: list[int] | tuple[int, ...] = (),
    eos_token_id: int | None = None,
    request_id: str = "r",
) -> CachedRequestState:
    """A worker-side request state, as the persistent batch holds it."""
    if eos_token_id is not None:
        params.update_from_generation_config({}, eos_token_id)
    return CachedRequestState(
        req_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_ids=[],
        num_computed_tokens=0,
        output_token_ids=list(output),
    )


def build(states: list[CachedRequestState], vocab_size: int, mode: str = "raw_logprobs"):
    """Metadata through the real path: the params are the engine's copy (normalized at
    admission), the states join a persistent batch, rows are sliced."""
    for state in states:
        if state.sampling_params is not None:
            state.sampling_params.normalize_for_engine(vocab_size)
    batch = InputBatch(len(states), 256, 1, vocab_size)
    rows = np.array([batch.add_request(s) for s in states], dtype=np.int64)
    return build_sampling_metadata(batch, rows, states, CPU, mode)


def replicate(md: SamplingMetadata, n: int) -> SamplingMetadata:
    """Metadata of one row, repeated for n identical rows (dense fields only)."""
    assert md.temperature.shape == (1,)
    assert not (
        md.generators
        or md.allowed_token_ids
        or md.bad_words_token_ids
        or md.min_tokens_stop_ids
        or md.logit_bias
    )
    assert md.repetition_penalties is None

    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat(n)

    return dataclasses.replace(
        md,
        temperature=rep(md.temperature),
        top_k=rep(md.top_k),
        top_p=rep(md.top_p),
        min_p=rep(md.min_p),
    )


def draw_counts(logits: list[float], params: SamplingParams, seed: int = 0) -> torch.Tensor:
    """Sample NUM_DRAWS tokens from one request's params on identical rows; return counts."""
    vocab = len(logits)
    md = replicate(build([make_request(params)], vocab), NUM_DRAWS)
    batch = torch.tensor(logits, dtype=torch.float32).expand(NUM_DRAWS, vocab).contiguous()
    torch.manual_seed(seed)
    sampled = Sampler()(batch, md).sampled_token_ids
    assert sampled.shape == (NUM_DRAWS,)
    return torch.bincount(sampled, minlength=vocab).double()


def reference_probs(
    logits: list[float],
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """fp64 reference: softmax(logits / T), min_p (relative to the scaled max prob), top-k,
    then the smallest prefix (descending) with renormalised mass >= top_p; renormalised."""
    x = torch.tensor(logits, dtype=torch.float64) / temperature
    p = x.softmax(0)
    threshold = min_p * float(p.max())
    for value in p.tolist():
        assert value == 0 or abs(value - threshold) > 1e-6, "test case too close to min_p cut"
    kept = [i for i in range(len(logits)) if p[i] >= threshold]
    kept.sort(key=lambda i: -float(x[i]))
    if top_k > 0:
        kept = kept[:top_k]
    mass = float(p[kept].sum())
    final: list[int] = []
    cum = 0.0
    for i in kept:
        assert abs(cum - top_p) > 1e-4, "test case too close to a top_p boundary"
        if cum >= top_p:
            break
        final.append(i)
        cum += float(p[i]) / mass
    out = torch.zeros_like(p)
    out[final] = p[final] / p[final].sum()
    return out


def chi2_critical(df: int) -> float:
    if _scipy_chi2 is not None:
        return float(_scipy_chi2.ppf(1.0 - _CHI2_ALPHA, df))
    # Wilson-Hilferty; for small df it over-estimates the quantile, i.e. it is conservative.
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + _Z_ALPHA * math.sqrt(c)) ** 3


def assert_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    n = float(counts.sum())
    zero = expected == 0
    assert counts[zero].sum() == 0, (
        f"sampled excluded tokens {torch.nonzero(zero & (counts > 0)).flatten().tolist()}"
    )
    empirical = counts / n
    tv = 0.5 * float((empirical - expected).abs().sum())
    assert tv < 0.03, f"total variation {tv:.4f}; got {empirical.tolist()}"
    # Pool the rarest bins until every bin expects >= 10 draws.
    order = sorted(torch.nonzero(~zero).flatten().tolist(), key=lambda i: float(expected[i]))
    bins: list[list[int]] = []
    pooled: list[int] = []
    for i in order:
        pooled.append(i)
        if float(expected[pooled].sum()) * n >= 10:
            bins.append(pooled)
            pooled = []
    if pooled:
        bins[-1].extend(pooled)
    e = torch.stack([expected[b].sum() for b in bins]) * n
    observed = torch.stack([counts[b].sum() for b in bins])
    df = len(bins) - 1
    if df == 0:
        return
    stat = float(((observed - e) ** 2 / e).sum())
    crit = chi2_critical(df)
    assert stat < crit, (
        f"chi2={stat:.1f} >= {crit:.1f} (df={df}); "
        f"got {empirical.tolist()}, expected {expected.tolist()}"
    )


# --------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    counts = draw_counts(LOGITS_12, SamplingParams(temperature=temperature))
    expected = torch.tensor(LOGITS_12, dtype=torch.float64).div(temperature).softmax(0)
    assert_distribution(counts, expected)


def test_temperature_distribution_without_the_c_sampler(monkeypatch) -> None:
    """The race against -log(U) that machines without the vectorized C sampler run."""
    monkeypatch.setattr("pagedlm.layers.sampler.kernels_for", lambda *tensors: None)
    counts = draw_counts(LOGITS_12, SamplingParams(temperature=0.7))
    expected = torch.tensor(LOGITS_12, dtype=torch.float64).div(0.7).softmax(0)
    assert_distribution(counts, expected)


def test_distribution_check_has_power() -> None:
    """The checker rejects a temperature-1 sample when told the law is T=0.5 or T=2."""
    counts = draw_counts(LOGITS_12, SamplingParams(temperature=1.0))
    for wrong in (0.8, 1.25):
        expected = torch.tensor(LOGITS_12, dtype=torch.float64).div(wrong).softmax(0)
        with pytest.raises(AssertionError):
            assert_distribution(counts, expected)


@pytest.mark.parametrize(
    ("temperature", "top_k", "support"),
    [(1.0, 1, [0]), (1.0, 3, [0, 1, 2]), (2.0, 5, [0, 1, 2, 3, 4]), (0.5, 11, list(range(11)))],
)
def test_top_k_distribution(temperature: float, top_k: int, support: list[int]) -> None:
    counts = draw_counts(LOGITS_12, SamplingParams(temperature=temperature, top_k=top_k))
    expected = reference_probs(LOGITS_12, temperature, top_k=top_k)
    assert torch.nonzero(expected).flatten().tolist() == support
    full = torch.tensor(LOGITS_12, dtype=torch.float64).div(temperature).softmax(0)
    torch.testing.assert_close(expected[support], full[support] / full[support].sum())
    assert_distribution(counts, expected)


@pytest.mark.parametrize(
    ("top_p", "support"),
    [
        # cum before token 1 is 0.35 < 0.5: the boundary token 1 is included (mass 0.6 >= 0.5).
        (0.5, [0, 1]),
        (0.61, [0, 1, 2]),
        (0.7, [0, 1, 2]),
        # 0.35 >= 0.3: a single token already covers p.
        (0.3, [0]),
        (0.9, [0, 1, 2, 3, 4]),
    ],
)
def test_top_p_distribution(top_p: float, support: list[int]) -> None:
    counts = draw_counts(LOGITS_8, SamplingParams(temperature=1.0, top_p=top_p))
    expected = torch.zeros(len(PROBS_8), dtype=torch.float64)
    kept = torch.tensor([PROBS_8[i] for i in support], dtype=torch.float64)
    expected[support] = kept / kept.sum()
    torch.testing.assert_close(expected, reference_probs(LOGITS_8, 1.0, top_p=top_p))
    assert_distribution(counts, expected)


def test_top_p_with_temperature() -> None:
    counts = draw_counts(LOGITS_12, SamplingParams(temperature=0.5, top_p=0.9))
    expected = reference_probs(LOGITS_12, 0.5, top_p=0.9)
    # At T=1 the 0.9 nucleus would hold 7 tokens; at T=0.5 it holds 4.
    assert int((expected > 0).sum()) == 4
    assert int((reference_probs(LOGITS_12, 1.0, top_p=0.9) > 0).sum()) == 7
    assert_distribution(counts, expected)


@pytest.mark.parametrize(
    ("temperature", "min_p"),
    [
        (1.0, 0.1),  # keeps logits within log(10) ~ 2.30 of the max: tokens 0..6
        (2.0, 0.1),  # scaled: within 4.61 of the max, tokens 0..10 (unscaled: 0..6)
        (0.5, 0.1),  # scaled: within 1.15 of the max, tokens 0..3
        (1.0, 0.5),
    ],
)
def test_min_p_distribution(temperature: float, min_p: float) -> None:
    counts = draw_counts(LOGITS_12, SamplingParams(temperature=temperature, min_p=min_p))
    expected = reference_probs(LOGITS_12, temperature, min_p=min_p)
    x = torch.tensor(LOGITS_12, dtype=torch.float64)
    kept = torch.nonzero(x >= x.max() + temperature * math.log(min_p)).flatten()
    assert torch.nonzero(expected).flatten().tolist() == kept.tolist()
    assert_distribution(counts, expected)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.5, 6, 0.8, 0.05),
        (0.7, 4, 0.9, 0.0),
        (2.0, 0, 0.75, 0.2),  # min_p removes tokens, then top_p works on the renormalised rest
        (1.0, 8, 0.95, 0.1),
        (0.8, 3, 1.0, 0.3),
    ],
)
def test_combined_filters_distribution(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    counts = draw_counts(LOGITS_12, params)
    assert_distribution(counts, reference_probs(LOGITS_12, temperature, top_k, top_p, min_p))


def test_top_p_renormalises_after_min_p() -> None:
    """T=2, min_p=0.2 keeps tokens 0..8; top_p=0.7 on that renormalised set keeps 0..4,
    while top_p on the full distribution would keep 0..5."""
    expected = reference_probs(LOGITS_12, 2.0, top_p=0.7, min_p=0.2)
    assert torch.nonzero(expected).flatten().tolist() == [0, 1, 2, 3, 4]
    assert int((reference_probs(LOGITS_12, 2.0, top_p=0.7) > 0).sum()) == 6
    params = SamplingParams(temperature=2.0, top_p=0.7, min_p=0.2)
    assert_distribution(draw_counts(LOGITS_12, params), expected)


def test_mixed_batch_rows_use_their_own_params() -> None:
    """Rows with different params in one batch each follow their own law."""
    params = [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=2.0, min_p=0.1),
    ]
    refs = [
        reference_probs(LOGITS_8, 0.5),
        reference_probs(LOGITS_8, 1.0, top_k=3),
        reference_probs(LOGITS_8, 1.0, top_p=0.5),
        reference_probs(LOGITS_8, 2.0, min_p=0.1),
    ]
    per = 5_000
    md = build([make_request(p, request_id=str(i)) for i, p in enumerate(params)], 8)
    index = torch.arange(len(params)).repeat_interleave(per)
    md = dataclasses.replace(
        md,
        temperature=md.temperature[index],
        top_k=md.top_k[index],
        top_p=md.top_p[index],
        min_p=md.min_p[index],
    )
    logits = torch.tensor(LOGITS_8).expand(len(index), 8).contiguous()
    torch.manual_seed(1)
    sampled = Sampler()(logits, md).sampled_token_ids.view(len(params), per)
    for row, ref in enumerate(refs):
        assert_distribution(torch.bincount(sampled[row], minlength=8).double(), ref)


def test_apply_top_k_top_p_values() -> None:
    logits = torch.tensor([LOGITS_8, LOGITS_8, LOGITS_8[::-1]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 8, 8]), torch.tensor([1.0, 0.5, 0.7]))
    inf = float("-inf")
    expected = torch.tensor(
        [
            LOGITS_8[:2] + [inf] * 6,
            LOGITS_8[:2] + [inf] * 6,
            [inf] * 5 + LOGITS_8[2::-1],
        ]
    )
    torch.testing.assert_close(out, expected)
    assert apply_top_k_top_p(logits, None, None) is logits


def test_disabled_top_p_row_is_left_unchanged() -> None:
    # A row whose top_p is 1.0 only gets a top_p tensor because another row enables top-p.
    logits = torch.tensor([[0.0] + [-20.0] * 15, [0.0] * 16])
    out = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(out[0], logits[0])


# --------------------------------------------------------------------------- greedy and seeds


def test_all_greedy_rows_take_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(32, 50) * 3
    requests = [
        make_request(SamplingParams(temperature=0.0, seed=i), request_id=str(i)) for i in range(32)
    ]
    md = build(requests, 50)
    assert md.all_greedy and not md.generators
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_mixed_with_random_rows() -> None:
    vocab, rows = 40, 64
    requests = []
    for i in range(rows):
        if i % 2 == 0:
            params = SamplingParams(temperature=0.0, seed=i if i % 4 == 0 else None)
        else:
            params = SamplingParams(temperature=1.5, top_k=5, top_p=0.9, min_p=0.01)
        requests.append(make_request(params, request_id=str(i)))
    md = build(requests, vocab)
    assert not md.all_greedy
    assert torch.equal(md.temperature[::2], torch.zeros(rows // 2))
    differs = 0
    for trial in range(5):
        torch.manual_seed(100 + trial)
        logits = torch.randn(rows, vocab)
        sampled = Sampler()(logits, md).sampled_token_ids
        argmax = logits.argmax(-1)
        assert torch.equal(sampled[::2], argmax[::2])
        differs += int((sampled[1::2] != argmax[1::2]).sum())
    assert differs > 0  # the random rows really sample


def test_seeded_rows_draw_vllms_stream() -> None:
    """A seeded row's token is argmax(softmax / q), q = exponential_ on its own generator, as
    vLLM's sampler draws it (so a seed gives vLLM's tokens on the same logits), whatever the
    unseeded rows beside it use."""
    vocab = 3000
    requests = [
        make_request(SamplingParams(temperature=0.7, seed=5), request_id="s"),
        make_request(SamplingParams(temperature=0.7), request_id="u"),
    ]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 4
    stream = torch.Generator().manual_seed(5)  # the request's generator, step after step
    for _ in range(5):
        got = Sampler()(logits, build(requests, vocab)).sampled_token_ids
        q = torch.empty(vocab).exponential_(generator=stream)
        assert got[0] == (logits[0] / 0.7).softmax(-1).div(q).argmax()
        logits = logits.roll(7, dims=1)


def _step_logits(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(vocab, generator=g) * 1.5


def _seeded_sequence(seed: int, with_companions: bool, global_seed: int, steps: int = 16):
    vocab = 24
    torch.manual_seed(global_seed)
    target = make_request(SamplingParams(temperature=1.0, seed=seed, max_tokens=64), request_id="t")
    companions: list[CachedRequestState] = []
    if with_companions:
        companions = [
            make_request(SamplingParams(temperature=1.0), request_id="a"),
            make_request(SamplingParams(temperature=0.8, seed=seed + 1, top_k=3), request_id="b"),
            make_request(SamplingParams(temperature=0.0), request_id="c"),
            make_request(
                SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
                request_id="d",
            ),
        ]
    rows = companions[:2] + [target] + companions[2:]
    position = rows.index(target)
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(rows), vocab) * 1.5
        logits[position] = _step_logits(step, vocab)
        sampled = Sampler()(logits, build(rows, vocab)).sampled_token_ids.tolist()
        for request, token in zip(rows, sampled, strict=True):
            request.output_token_ids.append(token)
        tokens.append(sampled[position])
    return tokens


def test_seeded_row_is_independent_of_the_batch() -> None:
    alone = _seeded_sequence(1234, with_companions=False, global_seed=0)
    in_batch = _seeded_sequence(1234, with_companions=True, global_seed=7)
    assert alone == in_batch
    assert alone == _seeded_sequence(1234, with_companions=True, global_seed=99)
    assert len(set(alone)) > 1


def test_different_seeds_give_different_sequences() -> None:
    a = _seeded_sequence(1234, with_companions=False, global_seed=0)
    b = _seeded_sequence(4321, with_companions=False, global_seed=0)
    assert a != b


def test_unseeded_rows_do_not_consume_seeded_generators() -> None:
    """Unseeded rows use the global RNG; a seeded row's generator advances once per step."""
    request = make_request(SamplingParams(temperature=1.0, seed=5))
    other = make_request(SamplingParams(temperature=1.0), request_id="o")
    md = build([other, request], 8)
    assert list(md.generators) == [1] and md.generators[1] is request.generator
    fresh = torch.Generator().manual_seed(5)
    logits = torch.tensor([LOGITS_8, LOGITS_8])
    Sampler()(logits, md)
    torch.empty(8).exponential_(generator=fresh)
    assert torch.equal(request.generator.get_state(), fresh.get_state())


# --------------------------------------------------------------------------- penalties


def _hf_repetition(logits_row: torch.Tensor, token_ids: list[int], penalty: float):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    ids = torch.tensor([token_ids], dtype=torch.long)
    return processor(ids, logits_row.unsqueeze(0).clone())[0]


PENALTY_CASES = [
    # (prompt, output, repetition, frequency, presence)
    ([1, 2, 3], [4, 4, 5], 1.3, 0.0, 0.0),
    ([0, 7, 7, 9], [7, 2], 0.7, 0.5, 0.0),
    ([3], [3, 3, 3, 8, 11], 2.0, 0.0, 1.5),
    ([5, 6], [6, 10, 10, 1], 1.0, 1.2, -0.5),
    ([2, 4], [], 1.5, 2.0, 2.0),  # no output: only the repetition penalty applies
    ([9, 9], [0, 11, 0, 0], 1.1, -1.0, 0.7),
]


def test_penalties_match_hf_and_openai_semantics() -> None:
    vocab = 12
    requests = [
        make_request(
            SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
            prompt=prompt,
            output=output,
            request_id=str(i),
        )
        for i, (prompt, output, rep, freq, pres) in enumerate(PENALTY_CASES)
    ]
    md = build(requests, vocab)
    torch.manual_seed(3)
    logits = torch.randn(len(requests), vocab) * 2
    logits[:, 0] = 0.0  # a zero logit is left unchanged by the repetition penalty
    out = Sampler.apply_penalties(logits.clone(), md)
    for row, (prompt, output, rep, freq, pres) in enumerate(PENALTY_CASES):
        expected = _hf_repetition(logits[row], prompt + output, rep)
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
        expected = expected - freq * counts - pres * (counts > 0).float()
        torch.testing.assert_close(out[row], expected, rtol=1e-6, atol=1e-6)


def test_repetition_penalty_matches_hf_per_token() -> None:
    """Positive logits are divided, negative ones multiplied, each seen token exactly once."""
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, -0.5]])
    request = make_request(
        SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 0], output=[2, 3, 3]
    )
    out = Sampler.apply_penalties(logits.clone(), build([request], 6))
    torch.testing.assert_close(out[0], torch.tensor([1.0, -4.0, 0.5, -2.0, 0.5, -0.5]))
    torch.testing.assert_close(out[0], _hf_repetition(logits[0], [0, 1, 0, 2, 3, 3], 2.0))


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 6)
    request = make_request(
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
        prompt=[0, 0, 1],
        output=[1, 2, 2, 2],
    )
    out = Sampler.apply_penalties(logits, build([request], 6))
    torch.testing.assert_close(out[0], torch.tensor([0.0, -1.5, -2.5, 0.0, 0.0, 0.0]))


def test_neutral_penalties_are_skipped() -> None:
    md = build([make_request(SamplingParams(), output=[1, 1])], 6)
    assert md.repetition_penalties is None
    logits = torch.randn(1, 6)
    assert Sampler.apply_penalties(logits, md) is logits


def test_penalties_follow_output_growth() -> None:
    """Metadata built at each step sees the tokens appended so far."""
    request = make_request(SamplingParams(frequency_penalty=1.0), prompt=[0])
    logits = torch.zeros(1, 4)
    for step in range(3):
        out = Sampler.apply_penalties(logits, build([request], 4))
        assert out[0, 3].item() == -float(step)
        request.output_token_ids.append(3)


# --------------------------------------------------------------------------- logits processors


def test_logit_bias_is_added() -> None:
    vocab = 10
    requests = [
        make_request(SamplingParams(logit_bias={3: 2.5, 7: -1.0}), request_id="a"),
        make_request(SamplingParams(), request_id="b"),
        make_request(SamplingParams.from_optional(logit_bias={"5": 150.0}), request_id="c"),
    ]
    md = build(requests, vocab)
    logits = torch.randn(3, vocab)
    out = Sampler.apply_logits_processors(logits, md)
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 7] -= 1.0
    expected[2, 5] += 100.0  # from_optional clamps to +100
    torch.testing.assert_close(out, expected)


def test_allowed_token_ids_mask_everything_else() -> None:
    vocab = 10
    requests = [
        make_request(SamplingParams(allowed_token_ids=[2, 5, 9]), request_id="a"),
        make_request(SamplingParams(), request_id="b"),
    ]
    md = build(requests, vocab)
    logits = torch.randn(2, vocab)
    out = Sampler.apply_logits_processors(logits, md)
    assert torch.isneginf(out[0]).tolist() == [i not in (2, 5, 9) for i in range(vocab)]
    torch.testing.assert_close(out[0, [2, 5, 9]], logits[0, [2, 5, 9]])
    torch.testing.assert_close(out[1], logits[1])


class _FakeTokenizer:
    """Just enough of a tokenizer for SamplingParams.update_from_tokenizer."""

    pieces = {
        "ab": [4],
        " ab": [5],
        "foo bar": [6, 7],
        " foo bar": [11, 7],
        "x y z": [8, 9, 10],
        " x y z": [8, 9, 10],  # same ids: the spaced variant is not added again
    }

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.pieces[text])

    def __len__(self) -> int:
        return 12


@pytest.mark.parametrize(
    ("prompt", "output", "banned"),
    [
        ([1], [], {4, 5}),  # single-token words are always banned
        ([1], [6], {4, 5, 7}),
        ([1], [11], {4, 5, 7}),
        ([1], [6, 3], {4, 5}),  # the prefix must match the end of the output
        ([1], [8, 9], {4, 5, 10}),
        ([1], [9], {4, 5}),  # a partial prefix does not count
        ([1], [0, 8, 9], {4, 5, 10}),
        ([1], [8, 9, 10], {4, 5}),
        ([8, 9], [], {4, 5}),  # only output tokens count, not the prompt
        ([1, 6], [], {4, 5}),
    ],
)
def test_bad_words(prompt: list[int], output: list[int], banned: set[int]) -> None:
    vocab = 12
    params = SamplingParams(bad_words=["ab", "foo bar", "x y z"])
    params.update_from_tokenizer(_FakeTokenizer())
    assert params.bad_words_token_ids == [[4], [5], [6, 7], [11, 7], [8, 9, 10]]
    requests = [
        make_request(params, prompt=prompt, output=output, request_id="a"),
        make_request(SamplingParams(), prompt=prompt, output=output, request_id="b"),
    ]
    logits = torch.randn(2, vocab)
    out = Sampler.apply_logits_processors(logits, build(requests, vocab))
    assert {i for i in range(vocab) if torch.isneginf(out[0, i])} == banned
    kept = [i for i in range(vocab) if i not in banned]
    torch.testing.assert_close(out[0, kept], logits[0, kept])
    torch.testing.assert_close(out[1], logits[1])


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    vocab = 12
    extra_eos = SamplingParams(min_tokens=2)
    extra_eos.update_from_generation_config({"eos_token_id": [2, 11]}, eos_token_id=2)
    cases = [
        # (params, num output tokens, masked)
        (SamplingParams(min_tokens=3, stop_token_ids=[7]), 0, [2, 7]),
        (SamplingParams(min_tokens=3, stop_token_ids=[7]), 2, [2, 7]),
        (SamplingParams(min_tokens=3, stop_token_ids=[7]), 3, []),
        (SamplingParams(min_tokens=3, stop_token_ids=[7]), 5, []),
        (SamplingParams(min_tokens=0, stop_token_ids=[7]), 0, []),
        (SamplingParams(min_tokens=2), 1, [2]),
        (extra_eos, 1, [2, 11]),
        (extra_eos, 2, []),
    ]
    requests = [
        make_request(params, output=[3] * n, eos_token_id=2, request_id=str(i))
        for i, (params, n, _) in enumerate(cases)
    ]
    logits = torch.randn(len(cases), vocab)
    out = Sampler.apply_logits_processors(logits, build(requests, vocab))
    for row, (_, _, masked) in enumerate(cases):
        assert [i for i in range(vocab) if torch.isneginf(out[row, i])] == masked, row
        kept = [i for i in range(vocab) if i not in masked]
        torch.testing.assert_close(out[row, kept], logits[row, kept])


def test_min_tokens_mask_lifts_as_output_grows() -> None:
    request = make_request(SamplingParams(temperature=0.0, min_tokens=2), eos_token_id=2, output=[])
    logits = torch.zeros(1, 5)
    logits[0, 2] = 10.0  # EOS is by far the argmax
    sampled = []
    for _ in range(3):
        token = Sampler()(logits, build([request], 5)).sampled_token_ids.item()
        sampled.append(token)
        request.output_token_ids.append(token)
    assert 2 not in sampled[:2]
    assert sampled[2] == 2


def test_no_processors_returns_logits_unchanged() -> None:
    md = build([make_request(SamplingParams(temperature=0.7, top_k=3))], 6)
    logits = torch.randn(1, 6)
    assert Sampler.apply_logits_processors(logits, md) is logits


def test_order_logit_bias_before_repetition_penalty() -> None:
    """Spec order: logit_bias (step 5) then repetition penalty (step 6)."""
    # token 1: (-0.1 + 1.5) / 4 = 0.35 < 0.6 = token 0; the other order would give 1.1.
    logits = torch.tensor([[0.6, -0.1, 0.0, 0.0]])
    request = make_request(
        SamplingParams(temperature=0.0, repetition_penalty=4.0, logit_bias={1: 1.5}),
        prompt=[1],
    )
    md = build([request], 4)
    processed = Sampler.apply_penalties(Sampler.apply_logits_processors(logits, md), md)
    torch.testing.assert_close(processed[0, 1], torch.tensor(0.35))
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0]


def test_allowed_mask_wins_over_logit_bias_and_penalties() -> None:
    logits = torch.tensor([[5.0, 0.0, -1.0, 1.0]])
    request = make_request(
        SamplingParams(
            temperature=0.0,
            allowed_token_ids=[2, 3],
            logit_bias={0: 100.0},
            repetition_penalty=0.5,
            frequency_penalty=-2.0,
        ),
        prompt=[0],
        output=[0],
    )
    md = build([request], 4)
    processed = Sampler.apply_penalties(Sampler.apply_logits_processors(logits, md), md)
    assert torch.isneginf(processed[0, :2]).all()
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [3]


def test_random_rows_never_sample_masked_tokens() -> None:
    vocab, rows = 10, 2_000
    params = SamplingParams(temperature=3.0, allowed_token_ids=[1, 4, 6], logit_bias={4: -100.0})
    requests = [make_request(params, request_id=str(i)) for i in range(rows)]
    torch.manual_seed(4)
    sampled = Sampler()(torch.randn(rows, vocab), build(requests, vocab)).sampled_token_ids
    assert set(sampled.tolist()) == {1, 6}


# --------------------------------------------------------------------------- logprobs


def test_gather_logprobs_top_k_and_ranks() -> None:
    logits = torch.tensor(
        [
            [0.1, 2.0, -1.0, 0.5, 1.5],
            [3.0, -2.0, 0.0, 1.0, 2.0],
            [0.0, 0.3, 0.2, 0.1, -0.1],
        ]
    )
    logprobs = logits.log_softmax(-1)
    tokens = torch.tensor([1, 2, 4])  # the argmax; the 4th best; the worst
    lists = gather_logprobs(logprobs, 2, tokens)
    assert lists.logprob_token_ids == [[1, 1, 4], [2, 0, 4], [4, 1, 2]]
    assert lists.sampled_token_ranks == [1, 4, 5]
    for row, ids in enumerate(lists.logprob_token_ids):
        assert lists.logprobs[row] == pytest.approx(logprobs[row, ids].tolist())


def test_gather_logprobs_zero_and_whole_vocab() -> None:
    torch.manual_seed(5)
    logprobs = torch.randn(3, 7).log_softmax(-1)
    tokens = torch.tensor([0, 3, 6])
    none = gather_logprobs(logprobs, 0, tokens)
    assert none.logprob_token_ids == [[0], [3], [6]]
    assert [v[0] for v in none.logprobs] == pytest.approx(
        logprobs.gather(1, tokens[:, None]).flatten().tolist()
    )
    assert all(len(v) == 1 for v in none.logprobs)
    everything = gather_logprobs(logprobs, 7, tokens)  # logprobs=-1: admission sends vocab
    for row, ids in enumerate(everything.logprob_token_ids):
        assert len(ids) == 8 and ids[0] == int(tokens[row])
        assert sorted(ids[1:]) == list(range(7))
        values = everything.logprobs[row]
        assert values[1:] == sorted(values[1:], reverse=True)
        assert values == pytest.approx(logprobs[row, ids].tolist())
        rank = everything.sampled_token_ranks[row]
        assert ids[rank] == int(tokens[row])  # position rank in the descending list
    expected = (logprobs > logprobs.gather(1, tokens[:, None])).sum(-1) + 1
    assert everything.sampled_token_ranks == expected.tolist()


def test_sampler_returns_raw_logprobs_with_sampled_token_first() -> None:
    vocab = 9
    torch.manual_seed(6)
    logits = torch.randn(3, vocab) * 2
    requests = [
        make_request(SamplingParams(temperature=0.0, logprobs=2), request_id="a"),
        make_request(
            SamplingParams(temperature=0.6, top_k=3, logprobs=4, repetition_penalty=1.5),
            output=[0, 1],
            request_id="b",
        ),
        make_request(SamplingParams(temperature=1.0, seed=3), request_id="c"),
    ]
    md = build(requests, vocab)
    assert md.max_num_logprobs == 4
    out = Sampler()(logits, md)
    raw = logits.log_softmax(-1)  # before penalties, temperature and filters
    lists = out.logprobs
    assert lists is not None
    sampled = out.sampled_token_ids.tolist()
    assert sampled[0] == logits[0].argmax().item() and lists.sampled_token_ranks[0] == 1
    for row in range(3):
        ids = lists.logprob_token_ids[row]
        assert len(ids) == 5 and ids[0] == sampled[row]
        assert ids[1:] == raw[row].topk(4).indices.tolist()
        assert lists.logprobs[row] == pytest.approx(raw[row, ids].tolist(), abs=1e-6)
        rank = int((raw[row] > raw[row, sampled[row]]).sum()) + 1
        assert lists.sampled_token_ranks[row] == rank


def test_sampler_whole_vocab_logprobs_and_raw_logits_mode() -> None:
    vocab = 6
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0, -0.5]])
    request = make_request(SamplingParams(temperature=0.0, logprobs=-1))
    md = build([request], vocab)
    assert md.max_num_logprobs == vocab
    lists = Sampler()(logits, md).logprobs
    assert lists is not None and len(lists.logprob_token_ids[0]) == vocab + 1
    assert lists.logprob_token_ids[0] == [2, 2, 4, 0, 3, 5, 1]
    md = build([request], vocab, mode="raw_logits")
    lists = Sampler()(logits, md).logprobs
    assert lists is not None
    assert lists.logprobs[0] == pytest.approx([2.0, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
