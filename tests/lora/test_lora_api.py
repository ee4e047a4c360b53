"""LoRA API and errors: bad adapters fail at add time naming themselves (nothing of the call is
queued; requests already in the engine are still served), add/remove/list/pin_lora, list
lengths, the lora_requests_info metric, and the scheduler's max_loras per step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.lora.request import LoRARequest
from tests.lora.peft_utils import make_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    return LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        max_lora_rank=8,
        disable_log_stats=False,
    )


def test_lora_not_enabled(tiny_qwen2, qwen2_adapters) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="but LoRA is not enabled"):
        llm.generate(PROMPTS, PARAMS, lora_request=LoRARequest("a1", 1, str(qwen2_adapters["a1"])))
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.llm_engine.list_loras()


def _bad_adapters(tmp: Path, tiny_qwen2, tiny_model_factory, good: Path) -> dict[str, Path]:
    missing_weights = tmp / "no-weights"
    missing_weights.mkdir()
    shutil.copy(good / "adapter_config.json", missing_weights)
    other = tiny_model_factory("qwen2", intermediate_size=96)
    return {
        "no such directory": tmp / "nowhere",
        "no adapter_model.safetensors": missing_weights,
        "rank 16 is above max_lora_rank=8": make_adapter(tiny_qwen2, tmp / "r16", r=16),
        "target modules \\['lm_head'\\] are not supported": make_adapter(
            tiny_qwen2, tmp / "head", targets=["q_proj", "lm_head"]
        ),
        "do not match the model": make_adapter(other, tmp / "other", r=4),
    }


def test_bad_adapters_fail_at_add_time(
    llm, tiny_qwen2, tiny_model_factory, qwen2_adapters, tmp_path
) -> None:
    good = LoRARequest("a1", 1, str(qwen2_adapters["a1"]))
    queued = llm.enqueue(PROMPTS, PARAMS, lora_request=good, use_tqdm=False)
    bad = _bad_adapters(tmp_path, tiny_qwen2, tiny_model_factory, qwen2_adapters["a1"])
    for i, (message, path) in enumerate(bad.items()):
        request = LoRARequest(f"bad{i}", 100 + i, str(path))
        with pytest.raises(ValueError, match=message) as info:
            llm.generate(PROMPTS, PARAMS, lora_request=[good, request], use_tqdm=False)
        assert f"bad{i}" in str(info.value)  # names the adapter
        # nothing of the failed call was queued; the earlier requests are still there
        assert llm.llm_engine.get_num_unfinished_requests() == len(queued)
    done = llm.wait_for_completion(use_tqdm=False)
    assert len(done) == 2 and all(len(o.outputs[0].token_ids) == 4 for o in done)
    assert all(o.lora_request == good for o in done)


def test_lora_request_list_length_and_id_reuse(llm, qwen2_adapters) -> None:
    a1, a2 = str(qwen2_adapters["a1"]), str(qwen2_adapters["a2"])
    with pytest.raises(ValueError, match="lengths of prompts \\(2\\) and lora_request \\(1\\)"):
        llm.generate(PROMPTS, PARAMS, lora_request=[LoRARequest("a1", 1, a1)], use_tqdm=False)
    first = llm.generate(PROMPTS, PARAMS, lora_request=LoRARequest("a1", 1, a1), use_tqdm=False)
    with pytest.raises(ValueError, match="already names adapter 'a1'"):
        llm.generate(PROMPTS, PARAMS, lora_request=LoRARequest("a2", 1, a2), use_tqdm=False)
    big = LoRARequest("a1-again", 2**40, a1)  # any positive id
    again = llm.generate(PROMPTS, PARAMS, lora_request=big, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_add_remove_list_pin(tiny_qwen2, qwen2_adapters) -> None:
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=64,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=8,
    )
    engine = llm.llm_engine
    reqs = [LoRARequest(n, i + 1, str(qwen2_adapters[n])) for i, n in enumerate(["a1", "a2", "a3"])]
    assert engine.list_loras() == set()
    assert engine.add_lora(reqs[0]) is True
    assert engine.add_lora(reqs[0]) is False  # already loaded
    assert engine.pin_lora(1) is True
    assert engine.add_lora(reqs[1]) and engine.add_lora(reqs[2])  # evicts 2, not pinned 1
    assert engine.list_loras() == {1, 3}
    with pytest.raises(ValueError, match="LoRA 2 is not registered"):
        engine.pin_lora(2)
    assert engine.remove_lora(3) is True and engine.remove_lora(3) is False
    assert engine.list_loras() == {1}
    # a removed adapter's requests still run (the worker loads it again)
    out = llm.generate(PROMPTS, PARAMS, lora_request=reqs[2], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_max_loras_per_step_and_metric(llm, qwen2_adapters) -> None:
    reqs = [LoRARequest(n, i + 1, str(qwen2_adapters[n])) for i, n in enumerate(["a1", "a2", "a3"])]
    engine = llm.llm_engine
    loras = [reqs[0], reqs[1], reqs[2], None, reqs[2]]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(5)]
    llm.enqueue(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    steps: list[tuple[set[str], int, str]] = []
    while engine.has_unfinished_requests():
        engine.step()
        running = {r.lora_request.lora_name for r in engine.scheduler.running if r.lora_request}
        assert len(running) <= 2  # max_loras
        info = [m for m in llm.get_metrics() if m.name == "vllm:lora_requests_info"]
        assert len(info) == 1  # this engine's current label set only
        labels = info[0].labels
        assert labels["max_lora"] == "2"
        assert set(filter(None, labels["running_lora_adapters"].split(","))) == running
        steps.append((running, len(engine.scheduler.running), labels["waiting_lora_adapters"]))
    # step 1: a1, a2 and the base request run; both a3 requests wait (skipped, not blocking)
    assert steps[0] == ({"a1", "a2"}, 3, "a3")
    assert any(running == {"a3"} for running, _, _ in steps[1:])


def test_async_llm_lora_matches_llm(llm, tiny_qwen2, qwen2_adapters) -> None:
    import asyncio

    from pagedlm import AsyncEngineArgs, AsyncLLMEngine

    a1, a2 = (LoRARequest(n, i + 1, str(qwen2_adapters[n])) for i, n in enumerate(["a1", "a2"]))
    args = AsyncEngineArgs(
        model=str(tiny_qwen2),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    engine = AsyncLLMEngine.from_engine_args(args)

    async def final(prompt, lora, request_id):
        last = None
        async for out in engine.generate(prompt, PARAMS, request_id, lora_request=lora):
            last = out
        return last

    async def main():
        assert await engine.add_lora(a2) is True
        assert await engine.list_loras() == {2}
        return await asyncio.gather(
            *(final(PROMPTS[0], lora, str(i)) for i, lora in enumerate([a1, a2, None]))
        )

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    want = llm.generate([PROMPTS[0]] * 3, PARAMS, lora_request=[a1, a2, None], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        list(o.outputs[0].token_ids) for o in want
    ]
    assert [o.lora_request for o in outs] == [a1, a2, None]


def test_parallel_sampling_children_use_the_adapter(llm, qwen2_adapters) -> None:
    a3 = LoRARequest("a3", 3, str(qwen2_adapters["a3"]))
    one = llm.generate(PROMPTS[:1], PARAMS, lora_request=a3, use_tqdm=False)[0]
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=4, ignore_eos=True, n=2)
    two = llm.generate(PROMPTS[:1], params, lora_request=a3, use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [one.outputs[0].token_ids] * 2
    assert two.lora_request == a3
