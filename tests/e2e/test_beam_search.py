"""LLM.beam_search against a plain reference beam search over transformers' fp32 logits."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedlm import LLM, TokensPrompt
from pagedlm.beam_search import BeamSearchOutput, get_beam_search_score
from pagedlm.sampling_params import BeamSearchParams

PROMPTS = ["The capital of France is", "def reverse(s):", "To be or not"]


@pytest.fixture(scope="module")
def llm(tiny_qwen2) -> LLM:
    return LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, seed=0, block_size=4)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32).eval()


@torch.no_grad()
def reference_beam_search(
    model,
    prompt_ids: list[int],
    width: int,
    max_tokens: int,
    eos: int,
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
) -> list[tuple[list[int], float]]:
    """Textbook beam search: expand each beam by its top 2*width tokens, keep the best width."""

    def score(item: tuple[list[int], float]) -> float:
        tokens, cum = item
        n = len(tokens) - (tokens[-1] == eos)
        return cum / n**length_penalty

    beams: list[tuple[list[int], float]] = [(list(prompt_ids), 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            values, ids = logits.log_softmax(-1).topk(2 * width)
            for v, t in zip(values.tolist(), ids.tolist(), strict=True):
                item = (tokens + [t], cum + v)
                (done if t == eos and not ignore_eos else candidates).append(item)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


def _check(out: BeamSearchOutput, ref: list[tuple[list[int], float]]) -> None:
    assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
    for seq, (_, cum) in zip(out.sequences, ref, strict=True):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (3, 1.0), (2, 0.5)])
def test_beams_and_scores_match_reference(llm, hf_model, width, length_penalty) -> None:
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt": p} for p in PROMPTS], params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        ref = reference_beam_search(
            hf_model, ids, width, 6, tok.eos_token_id, length_penalty=length_penalty
        )
        _check(out, ref)
        for seq in out.sequences:
            assert seq.tokens[: len(ids)] == ids
            # the prompt is part of the text; special tokens (the BOS here) are skipped
            assert seq.text == tok.decode(seq.tokens, skip_special_tokens=True)
            assert len(seq.logprobs) == len(seq.tokens) - len(ids)
            assert all(len(d) == 2 * width for d in seq.logprobs)  # greedy: argmax is in top-k
            assert seq.finish_reason is None and seq.stop_reason is None
            assert seq.orig_prompt["prompt_token_ids"] == ids


def test_skip_special_tokens_false_keeps_them_in_the_text(llm) -> None:
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=2, max_tokens=3, skip_special_tokens=False)
    for seq in llm.beam_search([{"prompt": PROMPTS[0]}], params)[0].sequences:
        assert seq.text == tok.decode(seq.tokens) and seq.text.startswith(tok.bos_token)


def test_eos_ends_beams_and_ignore_eos(llm, hf_model) -> None:
    """With EOS set to a token the model likes, beams complete early (and do not with
    ignore_eos); both agree with the reference."""
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[0])
    free = reference_beam_search(hf_model, ids, 2, 5, eos=-1)
    eos = free[0][0][len(ids) + 1]  # the best beam's second generated token
    old_eos = tok.eos_token
    tok.eos_token = tok.convert_ids_to_tokens(eos)
    try:
        assert tok.eos_token_id == eos
        for ignore_eos in (False, True):
            params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=ignore_eos)
            (out,) = llm.beam_search([TokensPrompt(prompt_token_ids=ids)], params)
            ref = reference_beam_search(hf_model, ids, 2, 5, eos, ignore_eos=ignore_eos)
            _check(out, ref)
            ended = [s for s in out.sequences if s.tokens[-1] == eos]
            if not ignore_eos:
                assert ended and all(len(s.tokens) < len(ids) + 5 for s in ended)
                seq = ended[0]
                assert get_beam_search_score(seq.tokens, seq.cum_logprob, eos) == pytest.approx(
                    seq.cum_logprob / (len(seq.tokens) - 1)
                )
    finally:
        tok.eos_token = old_eos


def test_concurrency_limit_and_progress_bar(llm, caplog) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    whole = llm.beam_search(PROMPTS, params)
    with caplog.at_level(logging.WARNING):
        chunked = llm.beam_search(PROMPTS, params, use_tqdm=True, concurrency_limit=2)
    assert "Disabling progress bar" in caplog.text
    assert [[s.tokens for s in o.sequences] for o in whole] == [
        [s.tokens for s in o.sequences] for o in chunked
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        llm.beam_search(PROMPTS[:1], params, use_tqdm=True)
    assert "upper bound on token steps" in caplog.text


def test_embeds_prompt_rejected(llm) -> None:
    with pytest.raises(NotImplementedError, match="beam search"):
        llm.beam_search([{"prompt_embeds": torch.zeros(2, 64)}], BeamSearchParams(2, 2))
