"""logprobs_mode processed_logits / processed_logprobs against a reference computed here from
the raw logits (penalties, temperature, min_p, top-k, top-p as vLLM defines them)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.rl.test_weight_transfer import ENGINE

PROMPT = {"prompt_token_ids": [5, 9, 9, 40, 41, 42, 9, 77]}
PARAMS = dict(
    max_tokens=6,
    temperature=0.8,
    top_k=40,
    top_p=0.9,
    min_p=0.02,
    repetition_penalty=1.3,
    frequency_penalty=0.4,
    presence_penalty=0.3,
    seed=7,
    logprobs=-1,
    prompt_logprobs=-1,
)


def vocab_vectors(output, vocab: int) -> list[torch.Tensor]:
    rows = []
    for entry in output.logprobs:
        row = torch.full((vocab,), float("nan"))
        for token, lp in entry.items():
            row[token] = lp.logprob
        rows.append(row)
    return rows


def processed_reference(raw: torch.Tensor, prompt: list[int], previous: list[int]):
    p = SamplingParams(**PARAMS)
    logits = raw.clone()
    counts = torch.zeros_like(logits)
    for t in previous:
        counts[t] += 1
    seen = counts > 0
    seen[prompt] = True
    logits = torch.where(
        seen,
        torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty),
        logits,
    )
    logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    logits = logits / p.temperature
    probs = logits.softmax(-1)
    logits[probs < probs.max() * p.min_p] = -math.inf
    kth = logits.sort(descending=True).values[p.top_k - 1]
    logits[logits < kth] = -math.inf
    ascending, order = logits.sort()
    cumulative = ascending.softmax(-1).cumsum(-1)
    drop = cumulative <= 1 - p.top_p
    drop[-1] = False
    logits[order[drop]] = -math.inf
    return logits


def run(model, mode: str):
    llm = LLM(str(model), logprobs_mode=mode, max_logprobs=-1, **ENGINE)
    out = llm.generate([PROMPT], SamplingParams(**PARAMS), use_tqdm=False)[0]
    return out, llm.model_config.vocab_size


@pytest.mark.parametrize("mode", ["processed_logits", "processed_logprobs"])
def test_processed_modes_match_reference(tiny_qwen2, mode):
    raw_out, vocab = run(tiny_qwen2, "raw_logits")
    out, _ = run(tiny_qwen2, mode)
    tokens = out.outputs[0].token_ids
    assert tokens == raw_out.outputs[0].token_ids  # the mode never changes sampling
    raw_rows = vocab_vectors(raw_out.outputs[0], vocab)
    got_rows = vocab_vectors(out.outputs[0], vocab)
    prompt = PROMPT["prompt_token_ids"]
    for i, (raw, got) in enumerate(zip(raw_rows, got_rows, strict=True)):
        want = processed_reference(raw, prompt, list(tokens[:i]))
        if mode == "processed_logprobs":
            want = want.log_softmax(-1)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), f"step {i}: masks differ"
        finite = ~torch.isinf(want)
        assert got[finite] == pytest.approx(want[finite], abs=1e-4), f"step {i}"
        assert not torch.isinf(got[tokens[i]])  # the sampled token survived every filter
    # prompt logprobs are raw log-probabilities in every mode, as in vLLM's runner
    raw_lp, _ = run(tiny_qwen2, "raw_logprobs")
    for got, want in zip(out.prompt_logprobs[1:], raw_lp.prompt_logprobs[1:], strict=True):
        for token, lp in want.items():
            assert got[token].logprob == pytest.approx(lp.logprob, abs=1e-5)


def test_unknown_logprobs_mode_is_refused(tiny_qwen2):
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(str(tiny_qwen2), logprobs_mode="processed", **ENGINE)


@pytest.mark.parametrize("mode", ["processed_logits", "processed_logprobs"])
def test_processed_modes_with_speculative_decoding(tiny_qwen2, mode):
    """Rows verified from n-gram drafts report the same processed values as plain decoding
    (allowed_token_ids makes processed differ from raw)."""
    prompt = {"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]}
    allowed = list(range(0, 512, 2)) + [7, 9]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, allowed_token_ids=allowed)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}

    def run(**kwargs):
        llm = LLM(str(tiny_qwen2), logprobs_mode=mode, **ENGINE, **kwargs)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    plain, drafted = run(), run(speculative_config=spec)
    assert drafted.token_ids == plain.token_ids
    for got, want in zip(drafted.logprobs, plain.logprobs, strict=True):
        assert got.keys() == want.keys()
        for token in want:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
    raw = LLM(str(tiny_qwen2), **ENGINE).generate([prompt], params, use_tqdm=False)[0]
    assert raw.outputs[0].logprobs[0] != plain.logprobs[0]  # the mask shows in processed
