"""start_profile / stop_profile write one Chrome trace per worker rank with the model's
forward in it; clear errors when unconfigured or already running."""

from __future__ import annotations

import gzip
import json

import pytest

from pagedlm import LLM, SamplingParams
from tests.rl.test_weight_transfer import ENGINE

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def load_trace(path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.parametrize("executor,tp", [("uni", 1), ("mp", 2)])
def test_profile_writes_one_trace_per_rank(tiny_qwen2, tmp_path, executor, tp):
    llm = LLM(
        str(tiny_qwen2),
        distributed_executor_backend=executor,
        tensor_parallel_size=tp,
        profiler_config={
            "profiler": "torch",
            "torch_profiler_dir": str(tmp_path),
            "torch_profiler_record_shapes": True,
        },
        **ENGINE,
    )
    try:
        llm.start_profile(profile_prefix="rollout")
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile()
        llm.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False)
        llm.stop_profile()
        traces = sorted(tmp_path.glob("rollout_rank*.json.gz"))
        assert [p.name.split("_")[1] for p in traces] == [f"rank{r}" for r in range(tp)]
        for path in traces:
            events = load_trace(path)
            names = {e.get("name", "") for e in events}
            assert any("LlamaModel.forward" in n or "Qwen2ForCausalLM" in n for n in names), sorted(
                names
            )[:40]
            assert any("aten::" in n for n in names)
            assert any(e.get("args", {}).get("Input Dims") for e in events)  # record_shapes
        llm.stop_profile()  # as vLLM: stopping a stopped profiler does nothing
        assert len(sorted(tmp_path.glob("rollout_rank*.json.gz"))) == tp
    finally:
        llm.llm_engine.shutdown()


def test_profile_needs_a_directory(tiny_qwen2, monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(str(tiny_qwen2), **ENGINE)
    with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(ValueError, match="torch_profiler_dir"):
        LLM(str(tiny_qwen2), profiler_config={"profiler": "torch"}, **ENGINE)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_TORCH_PROFILER_USE_GZIP", "0")
    llm = LLM(str(tiny_qwen2), **ENGINE)
    llm.start_profile()
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.stop_profile()
    (trace,) = tmp_path.glob("pagedlm_rank0_*.pt.trace.json")
    assert load_trace(trace)


def _steps_in(path) -> int:
    """Engine steps recorded in a trace: the worker's execute_model frames (with_stack)."""
    events = load_trace(path)
    return sum(
        1
        for e in events
        if e.get("name", "").endswith("execute_model")
        and e.get("ph") == "X"
        and "model_runner.py" in e.get("name", "")
    )


@pytest.mark.parametrize(
    "config,session,expected",
    [
        ({}, {}, 8),  # the whole session: 8 decode steps (+ the prefill one)
        ({"delay_iterations": 2, "max_iterations": 3}, {}, 3),
        ({"max_iterations": 5}, {"delay_iterations": 1, "max_iterations": 2}, 2),  # per session
        ({"wait_iterations": 1, "warmup_iterations": 2, "active_iterations": 2}, {}, 2),
    ],
)
def test_profile_iteration_windows(tiny_qwen2, tmp_path, config, session, expected):
    """vLLM's windows: skip `delay_iterations` steps, record at most `max_iterations`, or a
    wait / warm-up / active schedule; the trace holds exactly the recorded steps."""
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), **config}
    llm = LLM(str(tiny_qwen2), profiler_config=profiler, **ENGINE)
    llm.start_profile(**session)
    llm.generate([PROMPT], SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)
    llm.stop_profile()
    (trace,) = tmp_path.glob("pagedlm_rank0_*.json.gz")
    assert _steps_in(trace) == expected if config or session else _steps_in(trace) >= expected
    with pytest.raises(ValueError, match="max_iterations must be greater than or equal to 0"):
        llm.start_profile(max_iterations=-1)
    with pytest.raises(ValueError, match="active_iterations must be an int >= 1"):
        LLM(str(tiny_qwen2), profiler_config={**profiler, "active_iterations": 0}, **ENGINE)
