"""Tiny fp32 models at contexts of 300-500 tokens against transformers: 16-token blocks,
chunked prefill in 64-token steps (every chunk after the first attends a cached prefix through
the paged kernels), prefix-cache hits on a second pass, split-KV decode, Gemma 3's sliding and
global layers; and the logprob drift of an fp8 KV cache, bounded."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.models.test_gemma3 import make_tiny_gemma3
from tests.models.test_models_vs_hf import hf_greedy

MAX_TOKENS = 8
LLM_KWARGS = dict(
    dtype="float32",
    max_model_len=512,
    block_size=16,
    max_num_batched_tokens=64,
    enable_prefix_caching=True,
)


def _prompts() -> list[list[int]]:
    """Three long prompts; the second shares the first's first 256 tokens (16 blocks)."""
    rng = random.Random(0)
    first = [rng.randrange(5, 500) for _ in range(300)]
    second = first[:256] + [rng.randrange(5, 500) for _ in range(194)]
    third = [rng.randrange(5, 500) for _ in range(497)]
    return [first, second, third]


def _generate(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    tokens, logprobs = [], []
    for out in outputs:
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        logprobs.append([completion.logprobs[i][t].logprob for i, t in enumerate(tokens[-1])])
    return tokens, logprobs


def _check(model_dir: Path) -> None:
    want_tokens, want_logprobs = hf_greedy(model_dir, _prompts(), MAX_TOKENS)
    assert all(len(set(t)) >= 3 for t in want_tokens)  # the oracle is not degenerate
    llm = LLM(str(model_dir), **LLM_KWARGS)
    for _ in range(2):  # the second pass reads the prompts' blocks from the prefix cache
        tokens, logprobs = _generate(llm)
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs, strict=True):
            assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("llama", {"head_dim": 64}), ("qwen2", {})],
    ids=["llama-d16", "llama-d64", "qwen2"],
)
def test_long_prompts_match_transformers(tiny_model_factory, arch, overrides) -> None:
    _check(tiny_model_factory(arch, **overrides))


@pytest.mark.parametrize("window", [40, 128])
def test_gemma3_local_global_long_prompts(tmp_path, window) -> None:
    """Sliding layers with a window far shorter than the prompts, next to a global layer."""
    _check(make_tiny_gemma3(tmp_path, sliding_window=window, head_dim=64))


def _prompt_logprobs(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced logprob of every token after the first."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [
        torch.tensor(
            [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
        )
        for out, seq in zip(outputs, sequences, strict=True)
    ]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "calculate_kv_scales"),
    [("fp8", False), ("fp8_e5m2", False), ("fp8", True)],
)
def test_fp8_kv_cache_logprob_drift_is_bounded(
    tiny_model_factory, kv_cache_dtype, calculate_kv_scales
) -> None:
    """Teacher-forced logprobs over 300-500-token sequences: an fp8 cache stays within a bounded
    distance of the fp32 one (e4m3 keeps 3 mantissa bits, e5m2 2)."""
    model_dir = tiny_model_factory("llama", head_dim=64)
    sequences = [p + [7, 8, 9] for p in _prompts()]
    memory = dict(kv_cache_memory_bytes=8 << 20)
    exact_llm = LLM(str(model_dir), **memory, **LLM_KWARGS)
    fp8_llm = LLM(
        str(model_dir),
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=calculate_kv_scales,
        **memory,
        **LLM_KWARGS,
    )
    # fp32 model: a quarter of the bytes per block, four times the blocks in the same memory
    blocks = [x.llm_engine.cache_config.num_gpu_blocks for x in (exact_llm, fp8_llm)]
    assert blocks[1] == 4 * blocks[0]
    exact = _prompt_logprobs(exact_llm, sequences)
    approx = _prompt_logprobs(fp8_llm, sequences)
    diff = torch.cat([a - b for a, b in zip(approx, exact, strict=True)]).abs()
    # measured: e4m3 max 0.020 / mean 0.004, e5m2 0.043 / 0.010 (same on both paths)
    bound = 0.06 if kv_cache_dtype == "fp8" else 0.12
    assert diff.max() < bound and diff.mean() < bound / 5, (diff.max(), diff.mean())
    assert diff.max() > 0  # the cache really was fp8
    if calculate_kv_scales:  # the scales changed what the cache holds
        plain = LLM(str(model_dir), kv_cache_dtype=kv_cache_dtype, **memory, **LLM_KWARGS)
        assert not torch.equal(torch.cat(_prompt_logprobs(plain, sequences)), torch.cat(approx))
