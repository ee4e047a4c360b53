"""The same greedy tokens whatever the scheduling: preemption, chunking, batch size, order,
prefix caching. Invariants of the block pool are checked after every engine step."""

from __future__ import annotations

import random

import pytest

from pagedlm import LLM, SamplingParams

MAX_TOKENS = 10


def _prompts(n: int = 12) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(5, 500) for _ in range(20)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(5, 500) for _ in range(rng.randrange(1, 40))]
        prompts.append((shared if i % 2 else []) + tail)
    return prompts


def _run(model, prompts, check_invariants: bool = True, **kwargs) -> list[list[int]]:
    llm = LLM(str(model), dtype="float32", max_model_len=128, **kwargs)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs: dict[str, list[int]] = {}
    preempted = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        if check_invariants:
            engine.scheduler.check_invariants()
        preempted = max(preempted, engine.scheduler.num_preemptions)
    kv = engine.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks
    assert not kv.req_to_blocks
    _run.last_preemptions = preempted
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(tiny_qwen2):
    return _run(tiny_qwen2, _prompts(), enable_prefix_caching=False)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tiny_kv_pool_preempts_and_matches(tiny_qwen2, reference, prefix_caching) -> None:
    got = _run(
        tiny_qwen2,
        _prompts(),
        num_gpu_blocks_override=8,
        block_size=16,
        enable_prefix_caching=prefix_caching,
    )
    assert _run.last_preemptions > 0
    assert got == reference


def test_small_token_budget_chunks_every_prompt(tiny_qwen2, reference) -> None:
    assert _run(tiny_qwen2, _prompts(), max_num_batched_tokens=8) == reference


def test_prefix_caching_on_matches_off(tiny_qwen2, reference) -> None:
    assert _run(tiny_qwen2, _prompts(), enable_prefix_caching=True, block_size=4) == reference


def test_batch_of_one_matches_batch_of_many(tiny_qwen2, reference) -> None:
    assert _run(tiny_qwen2, _prompts(), max_num_seqs=1) == reference


def test_other_submission_order(tiny_qwen2, reference) -> None:
    prompts = _prompts()
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    got = _run(tiny_qwen2, [prompts[i] for i in order])
    assert [got[order.index(i)] for i in range(len(prompts))] == reference


def test_batch_of_32_matches_batch_of_1(tiny_qwen2) -> None:
    prompts = _prompts(32)
    assert _run(tiny_qwen2, prompts, check_invariants=False) == _run(
        tiny_qwen2, prompts, check_invariants=False, max_num_seqs=1
    )


def test_everything_small_at_once(tiny_qwen2, reference) -> None:
    got = _run(
        tiny_qwen2,
        _prompts(),
        num_gpu_blocks_override=40,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=3,
    )
    assert got == reference


def test_requests_in_one_step_share_a_prefix(tiny_qwen2) -> None:
    """Blocks of a prefill are registered when scheduled: the other requests of the same step
    hit them (as in vLLM) and still get the tokens computed without the cache."""
    shared = list(range(5, 45))  # two full blocks of 16, then 8 more tokens
    prompts = [{"prompt_token_ids": shared + [100 + i]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def generate(**kwargs):
        llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, block_size=16, **kwargs)
        return llm.generate(prompts, params, use_tqdm=False)

    cached = generate()
    assert [o.num_cached_tokens for o in cached] == [0, 32, 32, 32]
    uncached = generate(enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in uncached]


def test_preempted_request_sends_its_prompt_logprobs_once(tiny_qwen2) -> None:
    """Recomputing a preempted prompt does not emit its prompt logprobs again."""
    prompts = _prompts()
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1
    )
    runs = []
    for kwargs in ({}, {"num_gpu_blocks_override": 8, "block_size": 16}):
        llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append(outs)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for plain, preempted, prompt in zip(*runs, prompts, strict=True):
        assert len(preempted.prompt_logprobs) == len(prompt) == len(plain.prompt_logprobs)
        for a, b in zip(plain.prompt_logprobs[1:], preempted.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            assert [x.logprob for x in a.values()] == pytest.approx(
                [x.logprob for x in b.values()], abs=1e-5
            )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_last_layer_on_output_rows_only_matches_every_row(
    tiny_qwen2, monkeypatch, kv_cache_dtype
) -> None:
    """The last layer computing only the rows a step uses (sampled rows, prompt-logprob rows)
    gives the tokens and logprobs of computing every row: chunks of 1-7 tokens that do not
    sample, prompts scored whole next to prompts sampled, decodes in the same steps; with an
    fp8 cache too (the output rows read what the cache holds, as every row does)."""
    from pagedlm.models.llama import LlamaForCausalLM

    prompts = _prompts(8)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=6,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=2 if i % 3 == 0 else None,
        )
        for i in range(len(prompts))
    ]

    def generate():
        llm = LLM(
            str(tiny_qwen2),
            dtype="float32",
            max_model_len=128,
            max_num_batched_tokens=23,
            kv_cache_dtype=kv_cache_dtype,
        )
        runner = llm.llm_engine.model_executor.driver_worker.model_runner
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return runner._select_outputs, outs

    selected, rows_only = generate()
    monkeypatch.setattr(LlamaForCausalLM, "supports_output_rows", False)
    every_row, all_rows = generate()
    assert selected and not every_row
    for a, b in zip(rows_only, all_rows, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        steps = [*(a.prompt_logprobs or [])[1:], *a.outputs[0].logprobs]
        others = [*(b.prompt_logprobs or [])[1:], *b.outputs[0].logprobs]
        assert len(steps) == len(others)
        for x, y in zip(steps, others, strict=True):
            assert x.keys() == y.keys()
            assert [v.logprob for v in x.values()] == pytest.approx(
                [v.logprob for v in y.values()], abs=1e-5
            )
