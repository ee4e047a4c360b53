"""Speculative decoding (n-gram drafts and a draft model): greedy outputs identical to plain
decoding under any scheduling, sampled outputs keep the target distribution (rejection
sampling, chi-square), stop conditions are checked over every accepted token, metrics count
drafts."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.config import SpeculativeConfig
from pagedlm.spec_decode.ngram_proposer import NgramProposer
from pagedlm.spec_decode.rejection_sampler import verify_greedy, verify_random

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _prompts() -> list[list[int]]:
    """Repetitive prompts, so that prompt lookup finds drafts."""
    rng = random.Random(3)
    out = []
    for i in range(8):
        motif = [rng.randrange(5, 500) for _ in range(rng.randrange(3, 7))]
        out.append((motif * 6)[: 10 + 3 * i])
    return out


def _greedy(model, max_tokens: int = 20, **kwargs):
    llm = LLM(str(model), dtype="float32", max_model_len=128, disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
        for o in outs
    ]
    return tokens, logprobs, llm


def test_ngram_proposer_finds_the_latest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3))
    import numpy as np

    assert proposer.propose(np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])) == [7, 8, 1]
    assert proposer.propose(np.array([4, 5, 6, 4, 5])) == [6, 4, 5]
    assert proposer.propose(np.array([1, 2, 3, 4])) == []  # no earlier occurrence
    assert proposer.propose(np.array([7, 7])) == [7]  # the match is near the end


def test_verify_greedy_keeps_the_matching_prefix_and_one_more() -> None:
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]


def test_verify_random_keeps_the_target_distribution() -> None:
    """Each output position is distributed as the target, whether drafts are accepted or not."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25]])
    drafts = [0, 3]  # accepted with probability 0.5, then 0.6
    generator = torch.Generator().manual_seed(0)
    first, second = collections.Counter(), collections.Counter()
    trials = 20_000
    for _ in range(trials):
        out = verify_random(probs, drafts, generator)
        first[out[0]] += 1
        if out[0] == 0 and len(out) > 1:  # given the first draft was accepted
            second[out[1]] += 1
    for token, p in enumerate(probs[0].tolist()):
        assert abs(first[token] / trials - p) < 0.015
    accepted = sum(second.values())
    for token, p in enumerate(probs[1].tolist()):
        assert abs(second[token] / accepted - p) < 0.02


def test_verify_random_with_a_draft_distribution() -> None:
    """Drafts drawn from q, accepted with min(1, p/q), residual max(p - q, 0): output ~ p."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    generator = torch.Generator().manual_seed(1)
    counts = collections.Counter()
    trials = 20_000
    for _ in range(trials):
        draft = int(torch.multinomial(q[0], 1, generator=generator))
        counts[verify_random(p, [draft], generator, q)[0]] += 1
    for token, want in enumerate(p[0].tolist()):
        assert abs(counts[token] / trials - want) < 0.015


def _draft_config(model) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}


def test_draft_model_greedy_identical(tiny_qwen2, tiny_model_factory) -> None:
    want = _greedy(tiny_qwen2)
    # the target as its own draft: every draft is accepted
    tokens, logprobs, llm = _greedy(
        tiny_qwen2,
        speculative_config=_draft_config(tiny_qwen2),
        num_gpu_blocks_override=24,
        block_size=8,
        max_num_batched_tokens=24,
    )
    assert tokens == want[0]
    for a, b in zip(logprobs, want[1], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    metrics = {m.name: m for m in llm.get_metrics() if "spec_decode" in m.name}
    assert (
        metrics["vllm:spec_decode_num_accepted_tokens"].value
        == (metrics["vllm:spec_decode_num_draft_tokens"].value)
        > 0
    )
    # a different (1-layer) draft model: fewer accepted, the same tokens
    other = tiny_model_factory("qwen2", num_hidden_layers=1)
    assert _greedy(tiny_qwen2, speculative_config=_draft_config(other))[0] == want[0]


def test_greedy_identical_with_and_without_spec_decode(tiny_qwen2) -> None:
    want = _greedy(tiny_qwen2)
    got = _greedy(tiny_qwen2, speculative_config=NGRAM)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    metrics = {m.name: m for m in got[2].get_metrics() if "spec_decode" in m.name}
    assert metrics["vllm:spec_decode_num_drafts"].value > 0
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert 0 < accepted <= metrics["vllm:spec_decode_num_draft_tokens"].value
    assert sum(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == accepted


def test_spec_decode_under_preemption_chunking_and_prefix_cache(tiny_qwen2) -> None:
    want = _greedy(tiny_qwen2)[0]
    got = _greedy(
        tiny_qwen2,
        speculative_config=NGRAM,
        num_gpu_blocks_override=17,
        block_size=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    assert got[2].llm_engine.scheduler.num_preemptions > 0
    assert got[0] == want


def test_priority_preemption_with_drafts(tiny_qwen2) -> None:
    """Priority scheduling picks victims anywhere in the running list: low-priority requests
    running (with drafts) when urgent ones arrive are preempted after they were scheduled in
    the same step, and their drafts must leave the step with them (else the worker looks up a
    removed row, or drafts that never ran are rolled back). Tokens equal the run without
    drafts; invariants hold after every step."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts()
    late = len(prompts) // 2

    def run(**kwargs):
        llm = LLM(
            str(tiny_qwen2),
            dtype="float32",
            max_model_len=128,
            scheduling_policy="priority",
            num_gpu_blocks_override=16,
            block_size=8,
            **kwargs,
        )
        engine = llm.llm_engine
        done = {}

        def step():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            engine.scheduler.check_invariants()

        for i, prompt in enumerate(prompts[:late]):  # low priority, running first
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params, priority=5)
        for _ in range(2):
            step()
        for i, prompt in enumerate(prompts[late:], late):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params, priority=0)
        while engine.has_unfinished_requests():
            step()
        return [done[str(i)] for i in range(len(prompts))], engine.scheduler.num_preemptions

    want, _ = run()
    got, preemptions = run(speculative_config=NGRAM)
    assert preemptions > 0
    assert got == want


def test_stops_are_checked_over_every_accepted_token(tiny_qwen2) -> None:
    plain = _greedy(tiny_qwen2)[0]
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, speculative_config=NGRAM)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    stop_ids = [[tokens[5]] for tokens in plain]
    params = [SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=s) for s in stop_ids]
    for out, tokens, stop in zip(
        llm.generate(prompts, params, use_tqdm=False), plain, stop_ids, strict=True
    ):
        want = tokens[: tokens.index(stop[0]) + 1]
        assert list(out.outputs[0].token_ids) == want
        assert out.outputs[0].stop_reason == stop[0]
    short = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in short] == [7] * len(prompts)


def test_sampled_tokens_keep_the_target_distribution(tiny_qwen2) -> None:
    """Chi-square two-sample test on the 2nd and 3rd sampled tokens, with and without drafts."""
    chi2_contingency = pytest.importorskip("scipy.stats").chi2_contingency
    prompt = {"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]}
    num = 1500

    def histograms(**kwargs) -> list[collections.Counter]:
        llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, seed=1, **kwargs)
        params = [
            SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=i)
            for i in range(num)
        ]
        outs = llm.generate([prompt] * num, params, use_tqdm=False)
        return [collections.Counter(o.outputs[0].token_ids[pos] for o in outs) for pos in (1, 2)]

    plain = histograms()
    draft = {"method": "draft_model", "model": str(tiny_qwen2), "num_speculative_tokens": 2}
    for spec in (histograms(speculative_config=NGRAM), histograms(speculative_config=draft)):
        for a, b in zip(plain, spec, strict=True):
            tokens = sorted(set(a) | set(b))
            table = [[a[t] for t in tokens], [b[t] for t in tokens]]
            assert chi2_contingency(table).pvalue > 1e-4


def test_options_and_aliases(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), spec_method="ngram", spec_tokens=2)
    spec = llm.llm_engine.vllm_config.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 2)
    with pytest.raises(ValueError, match="min_p and logit_bias"):
        llm.generate("hi", SamplingParams(min_p=0.1), use_tqdm=False)
    with pytest.raises(NotImplementedError, match="eagle"):
        LLM(str(tiny_qwen2), speculative_config={"method": "eagle", "model": "x"})
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        LLM(str(tiny_qwen2), spec_model=str(tiny_qwen2), tensor_parallel_size=2)


@pytest.mark.slow
def test_default_model_greedy_identical_with_ngram_drafts(monkeypatch) -> None:
    """The packaged model rewriting code: the same tokens with and without drafts, with its
    weights dequantized, in fp32. (Packed GGUF weights quantize decode rows' activations to
    int8, but not those of multi-row verify steps, and bf16 rounds verify rows' GEMMs and
    attention differently from one-row decode: there near ties may flip, which
    benchmarks/spec_decode.py reports.)"""
    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", "1")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from spec_decode import conversations
    finally:
        sys.path.pop(0)
    params = SamplingParams(temperature=0.0, max_tokens=96)
    prompts = conversations(4)

    def tokens(**kwargs) -> list[list[int]]:
        llm = LLM("qwen2.5-coder-0.5b-instruct", dtype="float32", max_model_len=1024, **kwargs)
        return [list(o.outputs[0].token_ids) for o in llm.chat(prompts, params, use_tqdm=False)]

    assert tokens(speculative_config=NGRAM) == tokens()
