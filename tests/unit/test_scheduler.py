"""Scheduler with a fake model runner: budgets, chunking, preemption, priorities, invariants.

The fake runner samples a token for every request whose computed tokens reach its length this
step; the token is a deterministic function of the request's whole token list, so any schedule
(chunked, preempted, prefix-cached) must produce the same outputs.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.sched_output import EngineCoreOutput, SchedulerOutput
from pagedlm.core.scheduler import Scheduler
from pagedlm.runner_outputs import ModelRunnerOutput
from pagedlm.sampling_params import SamplingParams


def fake_token(token_ids: list[int]) -> int:
    return hash(tuple(token_ids)) % 97 + 3


def fake_runner(
    sched: Scheduler, so: SchedulerOutput, token_fn: Callable[[list[int]], int] = fake_token
) -> ModelRunnerOutput:
    sampled: dict[str, list[int]] = {}
    for rid in so.scheduled_req_ids:
        request = sched.requests[rid]
        if so.num_computed_tokens[rid] + so.num_scheduled_tokens[rid] == request.num_tokens:
            sampled[rid] = [token_fn(request.all_token_ids)]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    caching: bool = True,
    budget: int = 4096,
    max_num_seqs: int = 64,
    max_model_len: int = 256,
    policy: str = "fcfs",
    chunked: bool = True,
    threshold: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        scheduling_policy=policy,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(config, CacheConfig(block_size=block_size), kv)


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    block_size: int = 4,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = None,
    **params: object,
) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        block_size=block_size,
    )


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str | None] = field(default_factory=dict)
    finish_order: list[str] = field(default_factory=list)
    steps: list[SchedulerOutput] = field(default_factory=list)
    core_outputs: list[EngineCoreOutput] = field(default_factory=list)


def step(sched: Scheduler, run: Run, token_fn: Callable[[list[int]], int] = fake_token) -> None:
    had_work = sched.has_unfinished_requests()
    so = sched.schedule()
    # LLMEngine.step raises on an empty step while requests are unfinished.
    assert so.scheduled_req_ids or not had_work, "empty step with unfinished requests"
    config = sched.config
    assert so.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    assert len(so.scheduled_req_ids) == len(so.num_scheduled_tokens)
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    check_worker_diff(sched, so)
    requests = {rid: sched.requests[rid] for rid in so.scheduled_req_ids}
    for out in sched.update_from_output(so, fake_runner(sched, so, token_fn)):
        run.core_outputs.append(out)
        if out.finished:
            run.outputs[out.request_id] = list(requests[out.request_id].output_token_ids)
            run.finish_reasons[out.request_id] = out.finish_reason
            run.finish_order.append(out.request_id)
    run.steps.append(so)
    sched.check_invariants()
    check_block_tables(sched)


_WORKER_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_worker_diff(sched: Scheduler, so: SchedulerOutput) -> None:
    """Replay the plain-data diff as a worker would: its view of every scheduled request
    (tokens, blocks) must equal the scheduler's, and new requests are sent only once."""
    view = _WORKER_VIEWS.setdefault(sched, {})
    for rid in so.finished_req_ids:
        view.pop(rid, None)
    for new in so.scheduled_new_reqs:
        assert new.req_id not in view, f"{new.req_id} sent as new twice"
        view[new.req_id] = (list(new.prompt_token_ids), list(new.block_ids))
    cached = so.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        tokens, blocks = view[rid]
        tokens.extend(cached.new_token_ids[i])
        if cached.resumed_from_preemption[i]:
            blocks[:] = cached.new_block_ids[i]
        else:
            blocks.extend(cached.new_block_ids[i])
    for rid in so.scheduled_req_ids:
        request = sched.requests[rid]
        assert view[rid][0] == request.all_token_ids, rid
        assert view[rid][1] == sched.kv_cache_manager.get_block_ids(rid), rid


def check_block_tables(sched: Scheduler) -> None:
    """Invariants beyond Scheduler.check_invariants: exact table sizes and sharing."""
    kv = sched.kv_cache_manager
    running = {r.request_id: r for r in sched.running}
    assert set(kv.req_to_blocks) <= set(running)  # waiting requests hold nothing
    owners: dict[int, int] = {}
    for rid, blocks in kv.req_to_blocks.items():
        request = running[rid]
        assert len(blocks) == -(-request.num_computed_tokens // kv.block_size), request
        assert len({b.block_id for b in blocks}) == len(blocks)
        for b in blocks:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for block_id, n in owners.items():  # a block in two live tables must be a cached one
        assert n == 1 or kv.block_pool.blocks[block_id].block_hash is not None


def run_to_completion(
    sched: Scheduler,
    requests: list[Request],
    max_steps: int = 5000,
    on_step: Callable[[int], None] | None = None,
) -> Run:
    run = Run()
    for request in requests:
        sched.add_request(request)
    n = 0
    while sched.has_unfinished_requests():
        assert n < max_steps, "scheduler made no progress"
        if on_step is not None:
            on_step(n)
        step(sched, run)
        n += 1
    kv = sched.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks
    assert kv.req_to_blocks == {}
    assert sched.requests == {}
    return run


def clone(requests: list[Request], block_size: int) -> list[Request]:
    return [
        make_request(
            r.request_id,
            r.prompt_token_ids,
            r.max_tokens,
            block_size,
            r.priority,
            r.arrival_time,
        )
        for r in requests
    ]


def reference_outputs(requests: list[Request]) -> dict[str, list[int]]:
    """The tokens each request gets when run alone, one token per step, no cache."""
    out = {}
    for r in requests:
        tokens = list(r.prompt_token_ids)
        for _ in range(r.max_tokens):
            tokens.append(fake_token(tokens))
        out[r.request_id] = tokens[len(r.prompt_token_ids) :]
    return out


# ---------------------------------------------------------------------------- basics


def test_single_request_prefill_then_decodes() -> None:
    sched = make_scheduler()
    r = make_request("a", [5, 6, 7], max_tokens=3)
    run = run_to_completion(sched, [r])
    assert [so.num_scheduled_tokens for so in run.steps] == [{"a": 3}, {"a": 1}, {"a": 1}]
    assert [so.num_computed_tokens for so in run.steps] == [{"a": 0}, {"a": 3}, {"a": 4}]
    assert run.outputs == reference_outputs([r])
    assert run.finish_reasons == {"a": "length"}
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert run.steps[-1].finished_req_ids == set()
    assert sched.schedule().finished_req_ids == {"a"}  # reported on the next step


def test_chunked_prefill_advances_by_budget() -> None:
    sched = make_scheduler(budget=8)
    r = make_request("a", list(range(20)), max_tokens=2)
    run = run_to_completion(sched, [r])
    assert [so.num_scheduled_tokens["a"] for so in run.steps] == [8, 8, 4, 1]
    assert [so.num_computed_tokens["a"] for so in run.steps] == [0, 8, 16, 20]
    # Only the step that completes the prompt, and the decode, produce outputs.
    assert [len(o.new_token_ids) for o in run.core_outputs] == [1, 1]
    assert run.outputs == reference_outputs([r])


def test_long_prefill_threshold_caps_chunks() -> None:
    sched = make_scheduler(threshold=4)
    r = make_request("a", list(range(10)), max_tokens=1)
    run = run_to_completion(sched, [r])
    assert [so.num_scheduled_tokens["a"] for so in run.steps] == [4, 4, 2]


def test_decodes_and_prefills_share_steps() -> None:
    sched = make_scheduler(budget=8)
    a = make_request("a", [1, 2, 3, 4], max_tokens=6)
    run = Run()
    sched.add_request(a)
    step(sched, run)
    sched.add_request(make_request("b", list(range(30, 50)), max_tokens=2))
    step(sched, run)
    assert run.steps[-1].num_scheduled_tokens == {"a": 1, "b": 7}
    assert run.steps[-1].scheduled_req_ids == ["a", "b"]
    step(sched, run)
    assert run.steps[-1].num_scheduled_tokens == {"a": 1, "b": 7}
    step(sched, run)
    assert run.steps[-1].num_scheduled_tokens == {"a": 1, "b": 6}
    assert run.steps[-1].num_computed_tokens == {"a": 6, "b": 14}


def test_no_chunking_waits_for_a_budget_that_fits() -> None:
    sched = make_scheduler(budget=8, chunked=False)
    run = Run()
    sched.add_request(make_request("a", [1, 2], max_tokens=5))
    step(sched, run)
    sched.add_request(make_request("b", list(range(8)), max_tokens=1))  # 8 > 8 - 1
    sched.add_request(make_request("c", [9], max_tokens=1))  # behind b (FCFS)
    step(sched, run)
    assert run.steps[-1].num_scheduled_tokens == {"a": 1}
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    step(sched, run)
    assert run.steps[-1].num_scheduled_tokens == {"b": 8}


def test_max_num_seqs_limits_running() -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", [i + 1] * 3, max_tokens=3) for i in range(5)]
    run = run_to_completion(sched, reqs)
    assert max(len(so.scheduled_req_ids) for so in run.steps) == 2
    assert run.steps[0].num_scheduled_tokens == {"r0": 3, "r1": 3}
    assert run.finish_order == ["r0", "r1", "r2", "r3", "r4"]
    assert run.outputs == reference_outputs(reqs)


def test_token_budget_respected_with_many_requests() -> None:
    sched = make_scheduler(budget=10, max_num_seqs=8)
    reqs = [make_request(f"r{i}", list(range(i, i + 7)), max_tokens=5) for i in range(8)]
    run = run_to_completion(sched, reqs)
    assert max(so.total_num_scheduled_tokens for so in run.steps) == 10
    assert run.outputs == reference_outputs(reqs)


# ------------------------------------------------------------------------ preemption


def test_preemption_with_tiny_pool_gives_same_tokens() -> None:
    block_size = 2
    reqs = [make_request(f"r{i}", [i + 1, i + 2, i + 3], 8, block_size) for i in range(3)]
    # 3 prompts of 3 tokens need 6 blocks; each grows to 11 tokens = 6 blocks alone.
    sched = make_scheduler(num_blocks=8, block_size=block_size, max_model_len=64)
    run = run_to_completion(sched, reqs)
    assert sched.num_preemptions > 0
    preempted = set().union(*(so.preempted_req_ids for so in run.steps))
    assert preempted
    assert all(reqs[int(rid[1])].num_preemptions > 0 for rid in preempted)
    assert "r0" not in preempted  # FCFS: the newest running request goes first
    free = make_scheduler(num_blocks=64, block_size=block_size, max_model_len=64)
    unconstrained = run_to_completion(free, clone(reqs, block_size))
    assert free.num_preemptions == 0
    assert run.outputs == unconstrained.outputs == reference_outputs(reqs)


def test_preempted_request_frees_everything_and_recomputes() -> None:
    block_size = 2
    sched = make_scheduler(num_blocks=4, block_size=block_size, caching=False)
    a = make_request("a", [1, 2, 3], max_tokens=4, block_size=block_size)
    b = make_request("b", [4, 5, 6], max_tokens=4, block_size=block_size)
    run = Run()
    sched.add_request(a)
    sched.add_request(b)
    step(sched, run)  # both prefilled: 2 blocks each, pool full
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    step(sched, run)  # a and b decode position 3 in their second block
    step(sched, run)  # a needs a third block: b (newest) is preempted
    so = run.steps[-1]
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("b") == []
    assert list(sched.waiting) == [b]
    while sched.has_unfinished_requests():
        step(sched, run)
    # b recomputes prompt + its 2 earlier outputs in one step once a is gone.
    resumed = [s for s in run.steps if "b" in s.num_scheduled_tokens][2]
    assert resumed.num_scheduled_tokens["b"] == 5 and resumed.num_computed_tokens["b"] == 0
    assert run.outputs == reference_outputs([a, b])


def test_priority_serves_lower_value_first() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    reqs = [
        make_request("p5", [1, 2], priority=5, arrival_time=1.0),
        make_request("p1", [3, 4], priority=1, arrival_time=2.0),
        make_request("p3", [5, 6], priority=3, arrival_time=3.0),
        make_request("p1late", [7, 8], priority=1, arrival_time=4.0),
    ]
    run = run_to_completion(sched, reqs)
    assert run.finish_order == ["p1", "p1late", "p3", "p5"]
    assert run.outputs == reference_outputs(reqs)


def test_fcfs_ignores_priority() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="fcfs")
    reqs = [
        make_request("p5", [1, 2], priority=5, arrival_time=1.0),
        make_request("p1", [3, 4], priority=1, arrival_time=2.0),
        make_request("p3", [5, 6], priority=3, arrival_time=3.0),
    ]
    run = run_to_completion(sched, reqs)
    assert run.finish_order == ["p5", "p1", "p3"]


def _pressure_requests(block_size: int) -> list[Request]:
    # A has a 2-token prompt: its first decode step needs a new block. The others have 3-token
    # prompts, so their first decode token still fits in their second block.
    return [
        make_request("A", [1, 2], 4, block_size, priority=0, arrival_time=1.0),
        make_request("B", [3, 4, 5], 4, block_size, priority=2, arrival_time=2.0),
        make_request("C", [6, 7, 8], 4, block_size, priority=2, arrival_time=3.0),
        make_request("D", [9, 10, 11], 4, block_size, priority=1, arrival_time=4.0),
    ]


@pytest.mark.parametrize(
    "policy, running_order, victim",
    [("priority", ["A", "D", "B", "C"], "C"), ("fcfs", ["A", "B", "C", "D"], "D")],
)
def test_victim_under_pressure(policy: str, running_order: list[str], victim: str) -> None:
    block_size = 2
    sched = make_scheduler(num_blocks=7, block_size=block_size, policy=policy)
    reqs = _pressure_requests(block_size)
    run = Run()
    for r in reqs:
        sched.add_request(r)
    step(sched, run)  # all four admitted: 1 + 2 + 2 + 2 = 7 blocks
    assert [r.request_id for r in sched.running] == running_order
    step(sched, run)  # A needs an 8th block
    so = run.steps[-1]
    assert so.preempted_req_ids == {victim}
    assert set(so.num_scheduled_tokens) == {"A", "B", "C", "D"} - {victim}
    victim_req = next(r for r in reqs if r.request_id == victim)
    assert victim_req.status == RequestStatus.PREEMPTED
    while sched.has_unfinished_requests():
        step(sched, run)
    assert run.outputs == reference_outputs(reqs)


def test_priority_victim_already_scheduled_this_step_is_unscheduled() -> None:
    # lo is admitted first (alone), hi later, so running is [lo, hi]. In step 3 lo takes the
    # last free block, then hi needs one: the victim is lo, already scheduled this step; its
    # tokens must be taken out of the step and its computed count left at 0.
    block_size = 2
    sched = make_scheduler(num_blocks=4, block_size=block_size, policy="priority")
    lo = make_request("lo", [4, 5, 6], 4, block_size, priority=9, arrival_time=1.0)
    hi = make_request("hi", [1, 2], 4, block_size, priority=0, arrival_time=2.0)
    run = Run()
    sched.add_request(lo)
    step(sched, run)
    sched.add_request(hi)
    step(sched, run)  # lo decodes in its 2nd block; hi admitted with 1 block: 1 free
    assert [r.request_id for r in sched.running] == ["lo", "hi"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    step(sched, run)
    so = run.steps[-1]
    assert so.preempted_req_ids == {"lo"}
    assert so.num_scheduled_tokens == {"hi": 1}
    assert so.scheduled_req_ids == ["hi"] and so.num_computed_tokens == {"hi": 2}
    assert lo.status == RequestStatus.PREEMPTED and lo.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("lo") == []
    # lo's uncached tail block (3) went to the front of the free queue: hi gets it.
    assert sched.kv_cache_manager.get_block_ids("hi") == [2, 3]
    while sched.has_unfinished_requests():
        step(sched, run)
    assert run.finish_order == ["hi", "lo"]
    assert run.outputs == reference_outputs([lo, hi])


def test_priority_self_preemption_still_schedules_the_others() -> None:
    # x (low priority) is admitted alone first, so running is [x, y]. When x needs a block and
    # none is free, the victim is x itself; y (which fits) must still be scheduled this step.
    block_size = 2
    sched = make_scheduler(num_blocks=4, block_size=block_size, policy="priority")
    x = make_request("x", [1, 2, 3], 4, block_size, priority=9, arrival_time=1.0)
    y = make_request("y", [4, 5, 6], 4, block_size, priority=0, arrival_time=2.0)
    run = Run()
    sched.add_request(x)
    step(sched, run)
    sched.add_request(y)
    step(sched, run)  # x decodes in its 2nd block, y admitted with 2 blocks: pool full
    assert [r.request_id for r in sched.running] == ["x", "y"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    so = sched.schedule()
    assert so.preempted_req_ids == {"x"}
    assert so.num_scheduled_tokens == {"y": 1}  # got: {} (an empty step)


# -------------------------------------------------------------------- finish / abort


def test_abort_waiting_and_running_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    a = make_request("a", list(range(9)), max_tokens=10)
    b = make_request("b", [1, 2, 3], max_tokens=10)
    run = Run()
    sched.add_request(a)
    sched.add_request(b)
    step(sched, run)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert sched.kv_cache_manager.get_block_ids("a") == [0, 1, 2]
    sched.finish_requests(["b", "a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.get_finished_reason() == "abort"
    assert not sched.has_unfinished_requests() and sched.requests == {}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 8
    sched.check_invariants()
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.scheduled_req_ids == []
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # already gone: no-op


def test_abort_preempted_request() -> None:
    block_size = 2
    sched = make_scheduler(num_blocks=4, block_size=block_size)
    a = make_request("a", [1, 2, 3], max_tokens=4, block_size=block_size)
    b = make_request("b", [4, 5, 6], max_tokens=4, block_size=block_size)
    run = Run()
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        step(sched, run)
    assert b.status == RequestStatus.PREEMPTED
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert len(sched.waiting) == 0 and b.status == RequestStatus.FINISHED_ABORTED
    while sched.has_unfinished_requests():
        step(sched, run)
    assert set(run.outputs) == {"a"}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 4


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_keeps_the_rest_of_the_queue(policy: str) -> None:
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    reqs = [make_request(f"r{i}", [i + 1], 2, arrival_time=float(i)) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == ["r0", "r2", "r3"]
    run = run_to_completion(sched, [])
    assert run.finish_order == ["r0", "r2", "r3"]


# ------------------------------------------------------------------------ stops


def test_min_tokens_defers_eos() -> None:
    sched = make_scheduler()
    r = make_request("a", [1, 2, 3], max_tokens=10, eos_token_id=2, ignore_eos=False, min_tokens=3)
    run = Run()
    sched.add_request(r)
    for _ in range(3):
        assert sched.has_unfinished_requests()
        step(sched, run, token_fn=lambda tokens: 2)
    assert r.output_token_ids == [2, 2, 2]
    assert run.finish_reasons == {"a": "stop"}
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert not sched.has_unfinished_requests()


def test_eos_stops_without_min_tokens_and_ignore_eos_runs_on() -> None:
    sched = make_scheduler()
    stop = make_request("stop", [1, 2], max_tokens=5, eos_token_id=2, ignore_eos=False)
    ignore = make_request("ignore", [1, 2], max_tokens=5, eos_token_id=2, ignore_eos=True)
    run = Run()
    sched.add_request(stop)
    sched.add_request(ignore)
    while sched.has_unfinished_requests():
        step(sched, run, token_fn=lambda tokens: 2)
    assert run.outputs == {"stop": [2], "ignore": [2] * 5}
    assert run.finish_reasons == {"stop": "stop", "ignore": "length"}


def test_stop_token_ids_give_stop_reason() -> None:
    sched = make_scheduler()
    r = make_request("a", [1], max_tokens=10, stop_token_ids=[7], min_tokens=2)
    run = Run()
    sched.add_request(r)
    script = iter([7, 5, 7, 9])  # the first 7 is inside min_tokens: ignored
    while sched.has_unfinished_requests():
        step(sched, run, token_fn=lambda tokens: next(script))
    assert r.output_token_ids == [7, 5, 7]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
    last = run.core_outputs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == 7


def test_max_model_len_caps_length() -> None:
    sched = make_scheduler(max_model_len=6)
    r = make_request("a", [1, 2, 3, 4], max_tokens=10)
    run = run_to_completion(sched, [r])
    assert len(run.outputs["a"]) == 2 and run.finish_reasons == {"a": "length"}


# ------------------------------------------------------------------ prefix caching


def test_repeated_prompt_hits_cache_on_second_run() -> None:
    sched = make_scheduler(num_blocks=16, block_size=16)
    prompt = list(range(100, 117))  # 17 tokens: one full block + 1
    first = make_request("first", prompt, max_tokens=3, block_size=16)
    run1 = run_to_completion(sched, [first])
    assert first.num_cached_tokens == 0
    second = make_request("second", prompt, max_tokens=3, block_size=16)
    run2 = run_to_completion(sched, [second])
    assert second.num_cached_tokens == 16
    assert run2.steps[0].num_scheduled_tokens == {"second": 1}
    assert run2.steps[0].num_computed_tokens == {"second": 16}
    assert {o.num_cached_tokens for o in run2.core_outputs} == {16}
    assert run1.outputs["first"] == run2.outputs["second"]


def test_shared_prefix_hits_while_first_is_running() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    prefix = list(range(1, 9))
    a = make_request("a", prefix + [50], max_tokens=3)
    b = make_request("b", prefix + [60, 61], max_tokens=3)
    run = Run()
    sched.add_request(a)
    step(sched, run)
    sched.add_request(b)
    step(sched, run)
    assert b.num_cached_tokens == 8
    assert run.steps[-1].num_scheduled_tokens == {"a": 1, "b": 2}
    kv = sched.kv_cache_manager
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    while sched.has_unfinished_requests():
        step(sched, run)
    assert run.outputs == reference_outputs([a, b])


def test_reset_prefix_cache_refused_while_running() -> None:
    sched = make_scheduler()
    run = Run()
    sched.add_request(make_request("a", list(range(9)), max_tokens=3))
    step(sched, run)
    assert sched.reset_prefix_cache() is False
    assert sched.running and sched.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert not sched.running and len(sched.waiting) == 1
    assert sched.kv_cache_manager.block_pool.cached_block_hash_to_block == {}
    sched.check_invariants()


# -------------------------------------------------------------------- randomized


def random_workload(seed: int, block_size: int = 4) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 100) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    reqs = []
    for i in range(rng.randint(30, 60)):
        length = rng.randint(1, 60)
        if rng.random() < 0.6:
            prefix = rng.choice(prefixes)[:length]
            prompt = prefix + [rng.randrange(3, 100) for _ in range(length - len(prefix))]
        else:
            prompt = [rng.randrange(3, 100) for _ in range(length)]
        reqs.append(
            make_request(
                f"r{i}",
                prompt,
                rng.randint(1, 12),
                block_size,
                priority=rng.randint(0, 3),
                arrival_time=float(i),
            )
        )
    return reqs


BLOCK_SIZE = 4
MAX_MODEL_LEN = 80  # a prompt of 60 plus 12 outputs fits; the tiny pool holds one such request
TINY_POOL = MAX_MODEL_LEN // BLOCK_SIZE

CONFIGS = [
    # caching, budget, max_num_seqs, num_blocks, policy, chunked prefill
    (False, 4096, 64, 1024, "fcfs", True),
    (True, 4096, 64, 1024, "fcfs", True),
    (True, 8, 2, TINY_POOL, "fcfs", True),
    (False, 8, 8, TINY_POOL, "fcfs", True),
    (True, 32, 8, TINY_POOL + 4, "fcfs", True),
    (False, 32, 64, TINY_POOL, "priority", True),
    (True, 4096, 64, TINY_POOL, "priority", True),
    (True, 4096, 2, 2 * TINY_POOL, "fcfs", True),
    (True, 32, 64, TINY_POOL, "fcfs", True),
    (True, MAX_MODEL_LEN, 8, TINY_POOL, "fcfs", False),
]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_workload_identical_across_configs(seed: int) -> None:
    base = random_workload(seed, BLOCK_SIZE)
    assert 30 <= len(base) <= 60
    expected = reference_outputs(base)
    preemptions = cached = 0
    for caching, budget, max_num_seqs, num_blocks, policy, chunked in CONFIGS:
        sched = make_scheduler(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            caching=caching,
            budget=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            policy=policy,
            chunked=chunked,
        )
        requests = clone(base, BLOCK_SIZE)
        run = run_to_completion(sched, requests)
        assert run.outputs == expected, (caching, budget, max_num_seqs, num_blocks, policy)
        assert all(r.is_finished() for r in requests)
        preemptions += sched.num_preemptions
        cached += sum(r.num_cached_tokens for r in requests)
    assert preemptions > 0  # the tiny pools did force preemption
    assert cached > 0  # and the shared prefixes did hit the cache


def test_randomized_with_prefix_cache_resets_mid_run() -> None:
    base = random_workload(7, BLOCK_SIZE)
    sched = make_scheduler(
        num_blocks=TINY_POOL + 8, block_size=BLOCK_SIZE, budget=32, max_model_len=MAX_MODEL_LEN
    )

    def maybe_reset(n: int) -> None:
        if n % 9 == 4:
            assert sched.reset_prefix_cache(reset_running_requests=True) is True
            assert not sched.running
            sched.check_invariants()

    run = run_to_completion(sched, clone(base, BLOCK_SIZE), on_step=maybe_reset)
    assert run.outputs == reference_outputs(base)
    assert sched.num_preemptions > 0
