"""sleep / wake_up: levels 0-2, memory really returned (process RSS), same outputs after
waking, clear errors while asleep, the engine_sleep_state metric."""

from __future__ import annotations

import psutil
import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.rl.test_weight_transfer import ENGINE

KV_BYTES = 256 * 2**20
# max_model_len 512 x 256 sequences caps the cache at ~64 MiB for the tiny model
SLEEPY = dict(ENGINE, max_model_len=512, kv_cache_memory_bytes=KV_BYTES, enable_sleep_mode=True)
PROMPTS = [{"prompt_token_ids": list(range(10, 40))}, {"prompt_token_ids": [3, 4, 5]}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=2)


def run(llm: LLM):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [
                d[t].logprob
                for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        )
        for o in outs
    ]


def worker_rss(llm: LLM) -> int:
    return sum(llm.collective_rpc(lambda worker: psutil.Process().memory_info().rss))


def touch_kv_cache(llm: LLM) -> int:
    """Write every page of the (lazily mapped) KV cache; returns its bytes."""

    def touch(worker):
        for cache in worker.model_runner.kv_caches:
            cache.fill_(0.5)
        return worker.kv_cache_nbytes()

    return sum(llm.collective_rpc(touch))


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_level1_frees_kv_cache_and_wakes_with_same_outputs(tiny_qwen2, executor):
    llm = LLM(str(tiny_qwen2), distributed_executor_backend=executor, **SLEEPY)
    try:
        before = run(llm)
        kv_bytes = touch_kv_cache(llm)
        assert kv_bytes >= 32 * 2**20
        rss_awake = worker_rss(llm)
        llm.sleep(level=1)
        rss_asleep = worker_rss(llm)
        print(
            f"level 1 ({executor}): RSS {rss_awake / 2**20:.0f} MiB -> "
            f"{rss_asleep / 2**20:.0f} MiB (KV cache {kv_bytes / 2**20:.0f} MiB)"
        )
        assert rss_awake - rss_asleep >= 0.9 * kv_bytes
        assert llm.is_sleeping()
        with pytest.raises(RuntimeError, match="sleeping"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        # as in vLLM 0.32, scheduling resumes once the memory is resident again (only a level-0
        # pause needs the "scheduling" tag: test_level0_pauses_and_release_kv_cache_memory)
        assert llm.wake_up(tags=["kv_cache"]) is True
        assert llm.wake_up() is True
        assert not llm.is_sleeping()
        assert run(llm) == before
    finally:
        llm.llm_engine.shutdown()


def test_level2_discards_weights_until_reloaded(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), **SLEEPY)
    before = run(llm)
    kv_bytes = touch_kv_cache(llm)
    rss_awake = worker_rss(llm)
    llm.sleep(level=2)
    rss_asleep = worker_rss(llm)
    print(f"level 2: RSS {rss_awake / 2**20:.0f} MiB -> {rss_asleep / 2**20:.0f} MiB")
    assert rss_awake - rss_asleep >= 0.9 * kv_bytes
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    assert all(p.numel() == 0 for p in model.parameters())
    assert llm.wake_up() is True
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.collective_rpc("reload_weights")
    assert run(llm) == before


def test_level0_pauses_and_release_kv_cache_memory(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), **SLEEPY)
    before = run(llm)
    with pytest.raises(RuntimeError, match="sleep\\(level=0\\)"):
        llm.release_kv_cache_memory()
    llm.sleep(level=0)
    llm.enqueue(PROMPTS, GREEDY, use_tqdm=False)  # queued while paused
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.wait_for_completion(use_tqdm=False)
    kv_bytes = touch_kv_cache(llm)
    rss = worker_rss(llm)
    llm.release_kv_cache_memory()
    assert rss - worker_rss(llm) >= 0.9 * kv_bytes
    assert llm.wake_up(tags=["scheduling"]) is False
    assert llm.wake_up(tags=["kv_cache"]) is True
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [b[0] for b in before]


def test_level0_pause_needs_the_scheduling_tag(tiny_qwen2):
    """A level-0 pause stays until "scheduling" is woken, even once the KV cache released
    under it is back (a level >= 1 sleep resumes with the memory)."""
    llm = LLM(str(tiny_qwen2), **SLEEPY)
    llm.sleep(level=0)
    llm.release_kv_cache_memory()
    assert llm.wake_up(tags=["kv_cache"]) is False
    assert llm.wake_up(tags=["weights"]) is False
    assert llm.wake_up(tags=["scheduling"]) is True


def test_sleep_modes_wait_and_abort(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), **SLEEPY)
    llm.enqueue(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level=1, mode="wait")  # runs them to completion first
    llm.wake_up()
    assert len(llm.wait_for_completion(use_tqdm=False)) == 2
    llm.enqueue(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level=0, mode="abort")
    llm.wake_up()
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_sleep_needs_enable_sleep_mode_and_reports_metric(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), disable_log_stats=False, **ENGINE)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep(level=1)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])

    def state():
        return {
            m.labels["sleep_state"]: m.value
            for m in llm.get_metrics()
            if m.name == "vllm:engine_sleep_state"
            and m.labels["engine"] == llm.llm_engine.stat_logger._labels["engine"]
        }

    assert state() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    llm.sleep(level=0)
    assert state()["awake"] == 0
    llm.wake_up()
    assert state()["awake"] == 1


def test_level1_keep_recomputes_kept_requests(tiny_qwen2):
    """mode="keep" at level 1: the KV cache is freed under running requests; they are
    recomputed after waking and finish with the tokens an uninterrupted run gives."""
    llm = LLM(str(tiny_qwen2), **SLEEPY)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.enqueue(PROMPTS, params, use_tqdm=False)
    for _ in range(4):
        llm.llm_engine.step()
    llm.sleep(level=1, mode="keep")
    assert llm.wake_up() is True
    got = [o.outputs[0].token_ids for o in llm.wait_for_completion(use_tqdm=False)]
    assert got == want


def test_fp8_kv_cache_wakes_up_as_fp8(tiny_qwen2):
    """wake_up allocates the KV cache again in its own dtype, not the model's."""
    llm = LLM(str(tiny_qwen2), kv_cache_dtype="fp8", **SLEEPY)
    before = run(llm)
    dtypes = llm.collective_rpc(lambda w: {c.dtype for c in w.model_runner.kv_caches})
    llm.sleep(level=1)
    llm.wake_up()
    assert llm.collective_rpc(lambda w: {c.dtype for c in w.model_runner.kv_caches}) == dtypes
    assert dtypes == [{torch.float8_e4m3fn}]
    assert run(llm) == before


def test_sleep_frees_the_draft_models_cache_too(tiny_qwen2):
    """With a draft model, its layers' caches go with the target's and come back on waking."""
    draft = {"method": "draft_model", "model": str(tiny_qwen2), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_qwen2), speculative_config=draft, **SLEEPY)
    before = run(llm)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    layers = runner.attn_layers + runner.proposer.attn_layers
    llm.sleep(level=1)
    assert all(layer.kv_cache is None for layer in layers)
    llm.wake_up()
    assert all(layer.kv_cache is not None for layer in layers)
    assert run(llm) == before
