"""Metrics equal what was produced; priority order shows in completion order; cached tokens."""

from __future__ import annotations

import pytest

from pagedlm import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedlm.metrics import Counter, Gauge, Histogram


def test_metrics_count_the_tokens_produced(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, disable_log_stats=False)
    prompts = ["Hello", "The quick brown fox", "x y", "What is the meaning of life?"]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False
    )
    assert all(o.metrics is not None for o in outs)
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_total = sum(len(o.prompt_token_ids) for o in outs)
    engine = llm.llm_engine.stat_logger._labels["engine"]
    mine = [m for m in llm.get_metrics() if m.labels.get("engine") == engine]
    by_name = {m.name: m for m in mine if "finished_reason" not in m.labels}
    running = by_name["vllm:num_requests_running"]
    assert isinstance(running, Gauge) and running.value == 0.0
    gen = by_name["vllm:generation_tokens"]
    assert isinstance(gen, Counter) and gen.value == total
    assert by_name["vllm:prompt_tokens"].value == prompt_total
    hist = by_name["vllm:request_generation_tokens"]
    assert isinstance(hist, Histogram)
    assert hist.buckets["+Inf"] == hist.count == len(prompts) and hist.sum == total
    assert by_name["vllm:time_to_first_token_seconds"].count == len(prompts)
    success = [m for m in mine if m.name == "vllm:request_success"]
    assert sum(m.value for m in success) == len(prompts)


def test_metrics_disabled_by_default_for_llm(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64)
    out = llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.metrics is None
    with pytest.raises(AssertionError, match="Stat logging disabled"):
        llm.get_metrics()


def test_prefix_cache_hits_and_reset(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, block_size=16)
    prompt = {"prompt_token_ids": list(range(10, 27))}  # 17 tokens
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    third = llm.generate(prompt, params, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0


def test_priority_order_on_a_saturated_engine(tiny_qwen2) -> None:
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tiny_qwen2),
            dtype="float32",
            max_model_len=64,
            max_num_seqs=1,
            scheduling_policy="priority",
        )
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, priority in [("low", 5), ("high", 0), ("mid", 2)]:
        engine.add_request(rid, "Hello", params, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_priority_refused_under_fcfs(tiny_qwen2) -> None:
    """A non-zero priority is refused unless scheduling_policy='priority' (vLLM 0.32 ignores
    it silently; an ignored option is an option dropped, docs/compat.md); 0 is the default."""
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, max_num_seqs=1)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="Got priority 5 but Priority scheduling is not enabled"):
        engine.add_request("a", "Hello", params, priority=5)
    engine.add_request("b", "Hello", params, priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["b"]


def test_enqueue_and_wait_for_completion(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.enqueue(["Hello", "World"], params, use_tqdm=False)
    ids += llm.enqueue("Again", params, use_tqdm=False)
    assert len(ids) == 3 and llm.llm_engine.get_num_unfinished_requests() == 3
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert [o.prompt for o in outs] == ["Hello", "World", "Again"]
    direct = llm.generate(["Hello", "World", "Again"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in direct]


def test_enqueue_chat(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]]
    llm.enqueue_chat(conversations, params, use_tqdm=False)
    queued = llm.wait_for_completion(use_tqdm=False)
    direct = llm.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in queued] == [o.outputs[0].token_ids for o in direct]
