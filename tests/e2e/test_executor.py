"""Executors: `uni` and `mp` give the same answers; collective_rpc / apply_model reach every rank
in rank order, name the failing rank, time out; a dead worker is a clear error within seconds;
no worker process outlives its engine (del, exit, Ctrl-C, SIGKILL)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.executor.multiproc import WorkerDiedError, resolve_cpu_binding

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7], list(range(10, 40)), [42] * 9)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _worker_pid(worker) -> int:
    return os.getpid()


def _fail_on_rank_1(worker) -> int:
    if worker.rank == 1:
        raise ValueError("boom on purpose")
    return worker.rank


def _count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def mp_llm(tiny_qwen2):
    llm = LLM(
        str(tiny_qwen2), dtype="float32", max_model_len=128, distributed_executor_backend="mp"
    )
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def uni_llm(tiny_qwen2):
    return LLM(str(tiny_qwen2), dtype="float32", max_model_len=128)


def test_mp_executor_matches_uni(mp_llm, uni_llm) -> None:
    assert _tokens(mp_llm) == _tokens(uni_llm)
    assert mp_llm.collective_rpc(_worker_pid) != [os.getpid()]
    assert uni_llm.collective_rpc(_worker_pid) == [os.getpid()]


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_collective_rpc_and_apply_model(mp_llm, uni_llm, backend) -> None:
    llm = mp_llm if backend == "mp" else uni_llm
    assert llm.collective_rpc("check_health") == [True]
    assert llm.collective_rpc(lambda w, x, y=0: (w.rank, x + y), args=(2,), kwargs={"y": 3}) == [
        (0, 5)
    ]
    assert llm.apply_model(_count_params) == uni_llm.apply_model(_count_params)
    assert llm.get_world_size() == 1
    with pytest.raises(ZeroDivisionError) as info:
        llm.collective_rpc(lambda w: 1 / 0)
    assert "rank 0" in "".join(getattr(info.value, "__notes__", []))
    with pytest.raises(TimeoutError):
        llm.collective_rpc(lambda w: time.sleep(3), timeout=0.5)
    time.sleep(3)  # the slow call ends in the background; the engine is usable again
    assert _tokens(llm) == _tokens(uni_llm)


def test_tp2_ranks_in_order_and_failing_rank_named(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        assert llm.collective_rpc(lambda w: w.rank) == [0, 1]
        assert llm.get_world_size() == 2
        pids = llm.collective_rpc(_worker_pid)
        assert len(set(pids)) == 2 and os.getpid() not in pids
        with pytest.raises(ValueError, match="boom") as info:
            llm.collective_rpc(_fail_on_rank_1)
        assert "rank 1" in "".join(info.value.__notes__)
        halves = llm.apply_model(_count_params)
        assert halves[0] == halves[1]  # the shards are the same size
    finally:
        llm.llm_engine.shutdown()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_dead_worker_is_a_clear_error_within_seconds(tiny_qwen2) -> None:
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    (pid,) = [p for r, p in enumerate(llm.collective_rpc(_worker_pid)) if r == 1]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        _tokens(llm)  # rank 0 waits for rank 1 inside a collective: no hang
    assert time.monotonic() - start < 60  # a hang would wait for gloo's 30-minute timeout
    with pytest.raises(WorkerDiedError):
        _tokens(llm)


def test_del_llm_stops_workers(tiny_qwen2) -> None:
    llm = LLM(
        str(tiny_qwen2), dtype="float32", max_model_len=128, distributed_executor_backend="mp"
    )
    pids = llm.collective_rpc(_worker_pid)
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in pids)


_SCRIPT = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, time
    from pagedlm import LLM, SamplingParams

    faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a hang
    # Ctrl-C as in a terminal, also when the test runner was started as a background job
    # (which ignores SIGINT, and an ignored signal stays ignored across exec)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, tensor_parallel_size=2)
        print("PIDS", *llm.collective_rpc(lambda w: os.getpid()), flush=True)
        if sys.argv[2] == "exit":
            sys.exit(0)
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        while True:  # keep the workers busy until the signal arrives
            llm.generate([[5, 6, 7]] * 8, params, use_tqdm=False)
    """
)


@pytest.mark.parametrize("how", ["exit", "ctrl-c", "sigkill"])
def test_no_orphan_workers(tiny_qwen2, tmp_path, how) -> None:
    script = tmp_path / "engine.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, str(script), str(tiny_qwen2), "exit" if how == "exit" else "loop"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line
    pids = [int(p) for p in line.split()[1:]]
    if how == "ctrl-c":
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
    elif how == "sigkill":
        time.sleep(1)
        proc.kill()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack to stderr
        time.sleep(2)
        proc.kill()
        pytest.fail(f"engine alive 60 s after {how}; stderr:\n{stderr_path.read_text()[-6000:]}")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) for p in pids), f"orphaned workers after {how}"


def test_cpu_binding(monkeypatch) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    binding = resolve_cpu_binding(2)
    if len(cpus) >= 2:
        assert binding[0] and binding[1] and not set(binding[0]) & set(binding[1])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|0-1")
    assert resolve_cpu_binding(2) == [[0], [0, 1]]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    with pytest.raises(ValueError, match="one CPU list per rank"):
        resolve_cpu_binding(2)


def test_data_parallel_size_is_refused_in_one_process(tiny_qwen2) -> None:
    with pytest.raises(ValueError, match="not supported for single-process usage"):
        LLM(str(tiny_qwen2), data_parallel_size=2)


def test_data_parallel_example_equals_one_engine(tiny_qwen2, tmp_path) -> None:
    out = tmp_path / "dp.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/data_parallel.py"),
            "--model",
            str(tiny_qwen2),
            "--dp-size",
            "2",
            "--max-model-len",
            "128",
            "--max-tokens",
            "8",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DP rank 0: 20 prompts" in result.stdout and "DP rank 1: 20 prompts" in result.stdout
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from data_parallel import PROMPTS
    finally:
        sys.path.pop(0)
    llm = LLM(str(tiny_qwen2), max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = {str(i): o.outputs[0].text for i, o in enumerate(llm.generate(PROMPTS, params))}
    assert json.loads(out.read_text()) == want


_NO_GUARD_SCRIPT = """
import sys
from pagedlm import LLM, SamplingParams

# vLLM's examples/offline_inference/basic/basic.py shape: everything at module level
llm = LLM(sys.argv[1], dtype="float32", max_model_len=64, tensor_parallel_size=2)
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("TOKENS", *out[0].outputs[0].token_ids)
"""


@pytest.mark.parametrize("method", ["", "spawn", "forkserver"])
def test_script_without_main_guard_starts_workers(tiny_qwen2, tmp_path, method) -> None:
    """Spawned workers do not re-run the user's script (which would build the LLM again in
    every worker); VLLM_WORKER_MULTIPROC_METHOD is honoured."""
    script = tmp_path / "basic.py"
    script.write_text(_NO_GUARD_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_WORKER_MULTIPROC_METHOD": method}
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_qwen2)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("TOKENS")][0]
    assert [int(t) for t in line.split()[1:]] == list(expected[0].outputs[0].token_ids)


def test_bad_start_method_is_refused(monkeypatch) -> None:
    from pagedlm.executor.multiproc import worker_start_method

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "thread")
    with pytest.raises(ValueError, match="use fork, spawn or forkserver"):
        worker_start_method()
