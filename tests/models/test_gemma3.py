"""Tiny random Gemma 3 (text): greedy tokens and logprobs equal transformers' (fp32).

Prompts are shorter and longer than the 8-token sliding window; the model mixes sliding and
global layers, with different RoPE bases and linear rope scaling on the global layer only.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.models.gemma3 import gemma3_rope_params, layer_type
from tests.tiny_tokenizer import build_tiny_tokenizer

MAX_TOKENS = 10
PROMPT_LENGTHS = (3, 20, 45)
WINDOW = 8


def make_tiny_gemma3(path: Path, **overrides) -> Path:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    kwargs = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=32,
        rope_theta=10_000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,  # tied tiny models just repeat the last token
        architectures=["Gemma3ForCausalLM"],
    )
    kwargs.update(overrides)
    config = Gemma3TextConfig(**kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the default init, so distributions are not flat
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    build_tiny_tokenizer(path)
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def _hf_greedy(model_dir: Path) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens from HF generate; logprobs of them from one full forward (no cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in _prompts():
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones_like(ids),
            )
            generated = out[0, len(prompt) :].tolist()
            assert len(generated) == MAX_TOKENS  # no early EOS stop in the reference
            logits = model(out).logits[0, len(prompt) - 1 : -1].float()
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(generated)[:, None])[:, 0]
            tokens.append(generated)
            logprobs.append(lp.tolist())
    return tokens, logprobs


def _generate(model_dir: Path, **llm_kwargs) -> tuple[LLM, list[list[int]], list[list[float]]]:
    llm_kwargs.setdefault("max_model_len", 256)
    llm = LLM(str(model_dir), dtype="float32", **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    tokens, logprobs = [], []
    for out in outputs:
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        logprobs.append([completion.logprobs[i][t].logprob for i, t in enumerate(tokens[-1])])
    return llm, tokens, logprobs


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def hf_reference(tiny_gemma3) -> tuple[list[list[int]], list[list[float]]]:
    return _hf_greedy(tiny_gemma3)


def _assert_matches(got_tokens, got_logprobs, want_tokens, want_logprobs) -> None:
    for tokens, logprobs, want_t, want_lp in zip(
        got_tokens, got_logprobs, want_tokens, want_logprobs, strict=True
    ):
        assert tokens == want_t
        assert logprobs == pytest.approx(want_lp, abs=1e-4)


def test_greedy_matches_transformers(tiny_gemma3, hf_reference) -> None:
    assert all(len(set(t)) >= 3 for t in hf_reference[0])  # the oracle is not degenerate
    _, tokens, logprobs = _generate(tiny_gemma3)
    _assert_matches(tokens, logprobs, *hf_reference)


def test_chunked_prefill_matches_transformers(tiny_gemma3, hf_reference) -> None:
    """8-token chunks: later chunks attend to a cached prefix through the sliding window."""
    _, tokens, logprobs = _generate(tiny_gemma3, max_num_batched_tokens=8)
    _assert_matches(tokens, logprobs, *hf_reference)


def test_tiny_kv_pool_preempts_and_matches(tiny_gemma3, hf_reference) -> None:
    """20 blocks of 4 hold one 64-token sequence and all three prompts, not their outputs."""
    llm, tokens, logprobs = _generate(
        tiny_gemma3, max_model_len=64, block_size=4, num_gpu_blocks_override=20
    )
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_matches(tokens, logprobs, *hf_reference)


def test_final_logit_softcapping_matches_transformers(tmp_path) -> None:
    model_dir = make_tiny_gemma3(
        tmp_path,
        num_hidden_layers=2,
        layer_types=["full_attention", "sliding_attention"],
        final_logit_softcapping=3.0,
        tie_word_embeddings=True,
    )
    want_tokens, want_logprobs = _hf_greedy(model_dir)
    _, tokens, logprobs = _generate(model_dir)
    _assert_matches(tokens, logprobs, want_tokens, want_logprobs)


def test_rope_params_from_old_and_new_config_formats() -> None:
    old = SimpleNamespace(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=1024,
    )
    assert gemma3_rope_params(old, "sliding_attention") == (1e4, None)
    assert gemma3_rope_params(old, "full_attention") == (
        1e6,
        {"rope_type": "linear", "factor": 8.0},
    )
    new = SimpleNamespace(  # transformers >= 5: per layer type in rope_parameters
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
        max_position_embeddings=1024,
    )
    assert gemma3_rope_params(new, "sliding_attention") == (1e4, {"rope_type": "default"})
    assert gemma3_rope_params(new, "full_attention") == (
        1e6,
        {"rope_type": "linear", "factor": 8.0},
    )


def test_layer_types_from_sliding_window_pattern() -> None:
    config = SimpleNamespace(layer_types=None, sliding_window_pattern=3)
    kinds = [layer_type(config, i) for i in range(6)]
    assert kinds == ["sliding_attention", "sliding_attention", "full_attention"] * 2


def test_as_last_token_embedder_matches_transformers(tiny_gemma3) -> None:
    """Gemma 3 through the pooling adapter (runner="pooling"): each prompt's normalized last
    hidden state, prompts shorter and longer than the sliding window in one step."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_gemma3), runner="pooling", dtype="float32", max_model_len=64)
    outs = llm.embed([{"prompt_token_ids": p} for p in _prompts()], use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    for prompt, out in zip(_prompts(), outs, strict=True):
        with torch.no_grad():
            last = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(last, dim=-1)
        assert torch.tensor(out.outputs.embedding) == pytest.approx(want, abs=1e-4)
