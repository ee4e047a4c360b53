"""return_sampling_mask: each generated token's support, against one recomputed from
transformers' fp32 logits of the same sequence with a plain implementation of the filters."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.sampling_params import StructuredOutputsParams

PROMPTS = ["The capital of France is", "def reverse(s):", "To be or not"]


@pytest.fixture(scope="module")
def llm(tiny_qwen2) -> LLM:
    return LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, return_sampling_mask=True)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32).eval()


def reference_support(logits: torch.Tensor, p: SamplingParams, banned: list[int]) -> set[int]:
    """The tokens a sampler may draw: allowed ids, banned ids, then temperature, min_p,
    top-k (ties at the k-th value kept) and top-p (smallest prefix reaching top_p)."""
    x = logits.double().clone()
    if p.allowed_token_ids:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = float("-inf")
    x[banned] = float("-inf")
    if p.temperature < 1e-5:
        return set(torch.isfinite(x).nonzero().flatten().tolist())
    x = x / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    if p.top_k > 0:
        kth = x.sort(descending=True).values[p.top_k - 1]
        x[x < kth] = float("-inf")
    if p.top_p < 1.0:
        values, order = x.sort(descending=True)
        probs = values.softmax(-1)
        before = probs.cumsum(-1) - probs
        drop = before >= p.top_p
        drop[0] = False
        x[order[drop]] = float("-inf")
    return set(torch.isfinite(x).nonzero().flatten().tolist())


@torch.no_grad()
def _check(llm, hf_model, prompt: str, params: SamplingParams, banned: list[int]) -> None:
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    completion = out.outputs[0]
    mask = completion.sampling_mask
    assert mask is not None and len(mask.token_ids) == len(completion.token_ids) > 0
    ids = list(out.prompt_token_ids) + list(completion.token_ids)
    all_logits = hf_model(torch.tensor([ids])).logits[0]
    for step, token in enumerate(completion.token_ids):
        support = mask.token_ids[step]
        assert support == sorted(support) and token in support
        position = len(out.prompt_token_ids) - 1 + step
        expected = reference_support(all_logits[position], params, banned)
        assert set(support) == expected, (step, len(support), len(expected))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.3, min_p=0.1),
        dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.02),
        dict(temperature=0.0),  # greedy: the support is every finite logit
        dict(temperature=1.0, top_k=5, allowed_token_ids=list(range(30, 200))),
    ],
)
def test_mask_matches_reference(llm, hf_model, kwargs) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=3, **kwargs)
    _check(llm, hf_model, PROMPTS[0], params, banned=[])


def test_bad_words_are_outside_the_mask(llm, hf_model) -> None:
    tok = llm.get_tokenizer()
    # a word that is one token with and without a leading space: both variants are banned
    word = next(
        w
        for w in ("capital", "the", "is", "be")
        if len(tok.encode(w, add_special_tokens=False)) == 1
        and len(tok.encode(" " + w, add_special_tokens=False)) == 1
    )
    params = SamplingParams(
        temperature=0.9, top_k=40, max_tokens=5, ignore_eos=True, seed=1, bad_words=[word]
    )
    probe = params.clone()
    probe.update_from_tokenizer(tok)
    banned = [ids[0] for ids in probe.bad_words_token_ids]
    assert len(banned) == 2 and all(len(ids) == 1 for ids in probe.bad_words_token_ids)
    _check(llm, hf_model, PROMPTS[1], params, banned)


def test_grammar_mask_and_batching(llm) -> None:
    """Constrained rows report the grammar's support; the other rows of the batch keep theirs."""
    pytest.importorskip("xgrammar")
    so = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    outs = llm.generate(
        PROMPTS,
        [
            SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so),
            SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=0),
            SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=so, seed=2),
        ],
        use_tqdm=False,
    )
    backend = llm.llm_engine.structured_output_manager.backend
    for out in (outs[0], outs[2]):
        completion = out.outputs[0]
        assert completion.text in ("yes", "no", "maybe")
        grammar = backend.make_grammar(_choice_key(so))
        for token, support in zip(
            completion.token_ids, completion.sampling_mask.token_ids, strict=True
        ):
            bitmask = torch.zeros(1, backend.bitmask_width, dtype=torch.int32).numpy()
            grammar.fill_bitmask(bitmask, 0)
            allowed = [t for t in range(backend.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1]
            assert support == allowed  # no other filter: exactly the grammar's tokens
            assert grammar.accept_tokens("ref", [token])
    free = outs[1].outputs[0].sampling_mask.token_ids
    assert len(free) == 4 and all(len(s) >= 3 for s in free)  # top_k=3 (ties may add more)


def _choice_key(so: StructuredOutputsParams):
    from pagedlm.structured_output.request import get_structured_output_key

    return get_structured_output_key(so)


def test_off_by_default(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64)
    (out,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, seed=0), use_tqdm=False)
    assert out.outputs[0].sampling_mask is None
    assert "sampling_mask" not in repr(out.outputs[0])


def test_refused_with_speculative_decoding(tiny_qwen2) -> None:
    with pytest.raises(ValueError, match="return_sampling_mask is not supported"):
        LLM(
            str(tiny_qwen2),
            return_sampling_mask=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
