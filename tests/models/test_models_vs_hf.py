"""Tiny random models: our greedy tokens and logprobs equal transformers' (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedlm import LLM, SamplingParams

MAX_TOKENS = 12


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 40, 70, 5, 33][:n]
    return [[rng.randrange(5, 500) for _ in range(length)] for length in lengths]


def hf_reference(
    model_dir, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
) -> list[tuple[list[int], list[float], list[float]]]:
    """Per prompt, from transformers in fp32: the greedy tokens of HF generate, their logprobs
    and the prompt logprobs (tokens 1..P-1), from a full forward over prompt + output."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seq = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones_like(ids),
            )[0]
            logprobs = model(seq[None]).logits[0, :-1].float().log_softmax(-1)
            picked = logprobs.gather(-1, seq[1:, None])[:, 0].tolist()
            n = len(prompt)
            out.append((seq[n:].tolist(), picked[n - 1 :], picked[: n - 1]))
    return out


def hf_greedy(
    model_dir, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs per prompt (`hf_reference` without prompt logprobs)."""
    ref = hf_reference(model_dir, prompts, max_tokens)
    return [tokens for tokens, _, _ in ref], [logprobs for _, logprobs, _ in ref]


def _check_against_hf(model_dir, reference_dir=None, **llm_kwargs) -> None:
    """Our run of ``model_dir`` against transformers on ``reference_dir`` (default: the same)."""
    prompts = _prompts()
    want_tokens, want_logprobs = hf_greedy(reference_dir or model_dir, prompts)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, tokens, logprobs in zip(outputs, want_tokens, want_logprobs, strict=True):
        completion = out.outputs[0]
        assert list(completion.token_ids) == tokens
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)
        assert completion.cumulative_logprob == pytest.approx(sum(logprobs), abs=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers(tiny_model_factory, arch: str) -> None:
    _check_against_hf(tiny_model_factory(arch))


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_scaling_matches_transformers(tiny_model_factory, rope_scaling) -> None:
    arch = "qwen2" if rope_scaling["rope_type"] == "yarn" else "llama"
    _check_against_hf(tiny_model_factory(arch, rope_scaling=rope_scaling, rope_theta=1000.0))


def test_tied_embeddings_and_qkv_bias(tiny_model_factory) -> None:
    _check_against_hf(tiny_model_factory("llama", tie_word_embeddings=True, attention_bias=True))


def test_mistral_sliding_window_longer_than_window(tiny_model_factory) -> None:
    """Prompts of 40 and 70 tokens exceed a 16-token window: masks must match HF's."""
    _check_against_hf(tiny_model_factory("mistral", sliding_window=16))


def test_bf16_agrees_with_fp32_on_most_tokens(tiny_qwen2) -> None:
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(tiny_qwen2), dtype=dtype, max_model_len=256)
        results[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same = sum(
        a == b
        for x, y in zip(results["float32"], results["bfloat16"], strict=True)
        for a, b in zip(x, y, strict=True)
    )
    total = sum(len(x) for x in results["float32"])
    assert same / total >= 0.6, (same, total)


def test_unknown_architecture_lists_supported(tiny_qwen2, tmp_path) -> None:
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Supported architectures: .*Qwen2ForCausalLM"):
        LLM(str(bad))
