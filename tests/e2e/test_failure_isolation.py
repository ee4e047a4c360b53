"""A failure costs the requests it belongs to, never the engine.

- Ctrl-C (a real SIGINT) inside `LLM.generate`: the call's requests are aborted and the next
  call returns only its own outputs, equal to a clean run (uni and mp executors).
- An exception inside a step fails the request that raised (finish_reason "error"); every
  other request, seeded ones included, returns what it returns without the failure.
- mp with tensor parallelism: one rank's exception reaches the caller within seconds, naming
  the rank, although the other rank waits for it inside a collective; the workers are
  restarted and the engine goes on where a restart reproduces their state.
- Callables cross to worker processes only with VLLM_ALLOW_INSECURE_SERIALIZATION=1.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.executor.multiproc import WorkerDiedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
PROMPTS = [[5, 6, 7, i] for i in range(4)]
PARAMS = [GREEDY, SEEDED, GREEDY, SEEDED]
MARK = 3  # prompt_logprobs=MARK makes the patched worker raise for that request


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _make(path, backend: str, **kwargs) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        enable_prefix_caching=True,
        distributed_executor_backend=backend,
        **kwargs,
    )


def _raise_for_marked_request(worker) -> None:
    """Patch this worker: prompt logprobs of a request with prompt_logprobs=MARK raise."""
    runner = worker.model_runner
    original = runner._prompt_logprobs_of

    def patched(state, *args):
        if state.sampling_params.prompt_logprobs == MARK and worker.rank == worker.fail_rank:
            raise RuntimeError(f"injected failure on rank {worker.rank}")
        return original(state, *args)

    runner._prompt_logprobs_of = patched


def _arm(llm: LLM, fail_rank: int = 0) -> None:
    llm.collective_rpc(lambda w: setattr(w, "fail_rank", fail_rank))
    llm.collective_rpc(_raise_for_marked_request)


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_step_failure_costs_only_its_request(tiny_qwen2, backend) -> None:
    llm = _make(tiny_qwen2, backend)
    reference = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    _arm(llm)
    bad = SamplingParams(prompt_logprobs=MARK, max_tokens=4)
    outputs = llm.generate([*PROMPTS, [9, 9, 9]], [*PARAMS, bad], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 4 + ["error"]
    assert _tokens(outputs[:4]) == reference
    assert "injected failure on rank 0" in llm.llm_engine.last_step_error
    # the engine goes on, prefix caching included, and a failing request later in a batch
    # costs that request alone again
    outputs = llm.generate([[9, 9, 9], *PROMPTS], [bad, *PARAMS], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert _tokens(outputs[1:]) == reference
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
    llm.llm_engine.scheduler.check_invariants()


def test_running_requests_survive_a_failure_mid_generation(tiny_qwen2) -> None:
    """Requests already decoding when another one fails are recomputed and carry on."""
    llm = _make(tiny_qwen2, "uni")
    long = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(seed=3, max_tokens=30)]
    reference = _tokens(llm.generate(PROMPTS[:2], long, use_tqdm=False))
    _arm(llm)
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(PROMPTS[:2], long, strict=True)):
        engine.add_request(f"ok{i}", prompt, params)
    for _ in range(5):
        engine.step()
    engine.add_request("bad", [9, 9, 9], SamplingParams(prompt_logprobs=MARK, max_tokens=4))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.scheduler.check_invariants()
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert _tokens([finished["ok0"], finished["ok1"]]) == reference


@pytest.mark.parametrize(
    "backend,delay", [("uni", None), ("mp", None), ("mp", 0.02)], ids=["uni", "mp", "mp-wait"]
)
def test_ctrl_c_inside_generate_leaves_the_engine_serving(tiny_qwen2, backend, delay) -> None:
    """A real SIGINT inside the third step: sent before the step runs (delay None: it lands
    after the step was scheduled) or from a timer while the driver waits for the workers."""
    llm = _make(tiny_qwen2, backend)
    reference = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    engine = llm.llm_engine
    executor = engine.model_executor
    execute = executor.execute_model
    calls = 0

    def execute_then_signal(scheduler_output):
        nonlocal calls
        calls += 1
        if calls == 3:
            if delay is None:
                os.kill(os.getpid(), signal.SIGINT)
            else:
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
        return execute(scheduler_output)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    executor.execute_model = execute_then_signal
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in range(20):  # the timer may fire after a short call: call again
                llm.generate(PROMPTS * 4, SamplingParams(max_tokens=100, ignore_eos=True))
    finally:
        del executor.execute_model
        signal.signal(signal.SIGINT, previous)
    assert not engine.has_unfinished_requests()
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(outputs) == len(PROMPTS)
    assert _tokens(outputs) == reference
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("restartable", [True, False])
def test_rank_failure_reaches_the_caller_within_seconds(tiny_qwen2, restartable) -> None:
    """Rank 1 fails while rank 0 waits for it inside a collective. Workers whose state a
    restart reproduces are restarted and the engine goes on (the failed request alone has
    finish_reason "error"); workers changed by other calls are stopped, the engine is done."""
    llm = _make(tiny_qwen2, "mp", tensor_parallel_size=2)
    reference = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    _arm(llm, fail_rank=1)
    executor = llm.llm_engine.model_executor
    assert executor._unrestartable_by == "a callable"  # the patch itself is such a change
    if restartable:
        executor._unrestartable_by = None  # take the patched workers as the start state
    bad = SamplingParams(prompt_logprobs=MARK, max_tokens=4)
    start = time.monotonic()
    if restartable:
        outputs = llm.generate([*PROMPTS, [9, 9, 9]], [*PARAMS, bad], use_tqdm=False)
        elapsed = time.monotonic() - start
        assert [o.outputs[0].finish_reason for o in outputs][-1] == "error"
        assert _tokens(outputs[:4]) == reference
        assert "injected failure on rank 1" in llm.llm_engine.last_step_error
        # the restarted workers are unpatched: the same request now runs
        outputs = llm.generate([*PROMPTS, [9, 9, 9]], [*PARAMS, bad], use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 5
        assert _tokens(outputs[:4]) == reference
    else:
        with pytest.raises(RuntimeError, match="injected failure on rank 1") as info:
            llm.generate([[9, 9, 9]], bad, use_tqdm=False)
        elapsed = time.monotonic() - start
        notes = "".join(getattr(info.value, "__notes__", []))
        assert "worker rank 1" in notes and "cannot be restarted" in notes
        with pytest.raises(WorkerDiedError, match="create a new LLM"):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    # PAGEDLM_RANK_FAILURE_GRACE (5 s) and a restart, not gloo's 30-minute timeout
    assert elapsed < 60, elapsed


def test_callables_over_processes_need_the_opt_in(tiny_qwen2, monkeypatch) -> None:
    llm = _make(tiny_qwen2, "mp")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        llm.collective_rpc(lambda w: w.rank)
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        llm.apply_model(lambda model: type(model).__name__)
    assert llm.collective_rpc("check_health") == [True]  # by name: no opt-in needed
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    assert llm.collective_rpc(lambda w: w.rank) == [0]
    uni = _make(tiny_qwen2, "uni")  # in process: nothing is pickled, nothing to opt into
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
    assert uni.collective_rpc(lambda w: w.rank) == [0]
