"""AsyncLLM: concurrent coroutines share one engine loop; outputs equal LLM's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedlm import LLM, AsyncEngineArgs, AsyncLLMEngine, PoolingParams, SamplingParams
from pagedlm.exceptions import EngineDeadError
from pagedlm.sampling_params import RequestOutputKind

PROMPTS = [f"Hello, my name is {name} and I" for name in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef"]


def _engine(model, **kwargs) -> AsyncLLMEngine:
    args = AsyncEngineArgs(model=str(model), dtype="float32", max_model_len=64, **kwargs)
    return AsyncLLMEngine.from_engine_args(args)


def _greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


async def _final(engine, prompt, params, request_id):
    last = None
    async for out in engine.generate(prompt, params, request_id):
        last = out
    return last


def test_32_concurrent_generates_are_batched_and_match_llm(tiny_qwen2) -> None:
    engine = _engine(tiny_qwen2)

    async def main():
        ticks = 0

        async def ticker():  # runs while the steps are in the worker thread
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.create_task(ticker())
        outs = await asyncio.gather(
            *(_final(engine, p, _greedy(), str(i)) for i, p in enumerate(PROMPTS))
        )
        tick_task.cancel()
        return outs, ticks

    running_after_step: list[int] = []  # how many requests the scheduler runs at once
    core, step = engine.engine, engine.engine.step

    def observed_step():
        outputs = step()
        running_after_step.append(len(core.scheduler.running))
        return outputs

    core.step = observed_step
    outs, ticks = asyncio.run(main())
    engine.shutdown()
    assert ticks > len(outs)
    assert max(running_after_step) == len(PROMPTS)
    want = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64).generate(
        PROMPTS, _greedy(), use_tqdm=False
    )
    assert [o.request_id for o in outs] == [str(i) for i in range(len(PROMPTS))]
    assert all(o.finished for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
    assert [o.outputs[0].text for o in outs] == [w.outputs[0].text for w in want]


def test_output_kinds_stream_cumulative_delta_and_final_only(tiny_qwen2) -> None:
    engine = _engine(tiny_qwen2)

    async def collect(kind, rid):
        params = _greedy(6, output_kind=kind)
        return [o async for o in engine.generate(PROMPTS[0], params, rid)]

    async def main():
        return await asyncio.gather(
            collect(RequestOutputKind.CUMULATIVE, "c"),
            collect(RequestOutputKind.DELTA, "d"),
            collect(RequestOutputKind.FINAL_ONLY, "f"),
        )

    cumulative, delta, final_only = asyncio.run(main())
    engine.shutdown()
    assert len(final_only) == 1 and final_only[0].finished
    final_ids = final_only[0].outputs[0].token_ids
    assert len(final_ids) == 6
    assert len(cumulative) == len(delta) == 6
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    assert cumulative[-1].outputs[0].token_ids == final_ids
    assert [t for o in delta for t in o.outputs[0].token_ids] == final_ids
    assert "".join(o.outputs[0].text for o in delta) == final_only[0].outputs[0].text
    assert [o.finished for o in delta] == [False] * 5 + [True]


def test_bad_request_fails_alone_and_loop_keeps_running(tiny_qwen2) -> None:
    engine = _engine(tiny_qwen2)

    async def main():
        good = [
            asyncio.create_task(_final(engine, p, _greedy(), str(i)))
            for i, p in enumerate(PROMPTS[:4])
        ]
        bad_len = asyncio.create_task(_final(engine, "x " * 200, _greedy(), "too-long"))
        bad_vocab = asyncio.create_task(_final(engine, [10**6], _greedy(), "bad-vocab"))
        results = await asyncio.gather(*good, bad_len, bad_vocab, return_exceptions=True)
        # A duplicate live id is refused, the original request is unaffected.
        first = engine.generate(PROMPTS[0], _greedy(4), "dup")
        out = await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _final(engine, PROMPTS[1], _greedy(), "dup")
        rest = [o async for o in first]
        after = await _final(engine, PROMPTS[5], _greedy(), "after")
        return results, out, rest, after

    results, first_out, rest, after = asyncio.run(main())
    assert all(r.finished for r in results[:4])
    assert isinstance(results[4], ValueError) and "maximum context length" in str(results[4])
    assert isinstance(results[5], ValueError) and "out of vocabulary" in str(results[5])
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 4
    assert not first_out.finished or len(first_out.outputs[0].token_ids) == 4
    assert after.finished
    assert engine.is_running and not engine.engine.has_unfinished_requests()
    engine.shutdown()
    assert not engine.is_running


def test_abort_and_early_break_free_the_request(tiny_qwen2) -> None:
    engine = _engine(tiny_qwen2)

    async def main():
        gen = engine.generate(PROMPTS[0], _greedy(40, output_kind=RequestOutputKind.DELTA), "a")
        await gen.__anext__()
        await engine.abort("a")
        with pytest.raises(asyncio.CancelledError):
            async for _ in gen:
                pass
        gen2 = engine.generate(PROMPTS[1], _greedy(40, output_kind=RequestOutputKind.DELTA), "b")
        async for _ in gen2:
            break
        await gen2.aclose()
        # The next request runs; the loop aborted "b" before its next step.
        return await _final(engine, PROMPTS[2], _greedy(3), "c")

    out = asyncio.run(main())
    assert out.finished and len(out.outputs[0].token_ids) == 3
    assert not engine.engine.has_unfinished_requests()
    engine.shutdown()


def test_step_error_kills_engine_with_engine_dead_error(tiny_qwen2) -> None:
    engine = _engine(tiny_qwen2)

    def broken_step():
        raise RuntimeError("boom")

    engine.engine.step = broken_step

    async def main():
        return await asyncio.gather(
            _final(engine, PROMPTS[0], _greedy(), "0"),
            _final(engine, PROMPTS[1], _greedy(), "1"),
            return_exceptions=True,
        )

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in results)
    assert engine.errored and not engine.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(_final(engine, PROMPTS[2], _greedy(), "2"))
    engine.shutdown()


def test_encode_matches_llm_embed(tiny_qwen2) -> None:
    engine = _engine(tiny_qwen2, runner="pooling", convert="embed")

    async def one(i, p):
        outs = [o async for o in engine.encode(p, PoolingParams(task="embed"), f"e{i}")]
        assert len(outs) == 1 and outs[0].finished
        return outs[0]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS[:6])))

    outs = asyncio.run(main())
    engine.shutdown()
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=64, runner="pooling", convert="embed")
    want = llm.embed(PROMPTS[:6], use_tqdm=False)
    for got, ref in zip(outs, want, strict=True):
        torch.testing.assert_close(
            got.outputs.data, torch.tensor(ref.outputs.embedding), atol=1e-5, rtol=1e-5
        )


def test_tokenizer_and_generate_rejects_pooling_params(tiny_qwen2) -> None:
    engine = _engine(tiny_qwen2)

    async def main():
        tok = await engine.get_tokenizer()
        with pytest.raises(TypeError, match="SamplingParams"):
            await _final(engine, "hi", PoolingParams(), "p")
        return tok

    tok = asyncio.run(main())
    assert tok.encode("Hello") == engine.engine.get_tokenizer().encode("Hello")
    engine.shutdown()
    assert engine.is_stopped


def test_sleep_and_wake_up(tiny_qwen2) -> None:
    """vLLM 0.32's AsyncLLM has sleep / wake_up / is_sleeping: a level-1 sleep in mode "wait"
    finishes the running streams, the loop pauses while asleep (a request added then waits),
    and waking weights then KV cache resumes scheduling by itself."""
    engine = _engine(tiny_qwen2, enable_sleep_mode=True)
    want = asyncio.run(_final(engine, PROMPTS[0], _greedy(), "ref")).outputs[0].token_ids

    async def main():
        running = asyncio.ensure_future(_final(engine, PROMPTS[0], _greedy(30), "a"))
        await asyncio.sleep(0.05)
        await engine.sleep(level=1, mode="wait")
        assert await engine.is_sleeping()
        assert len((await running).outputs[0].token_ids) == 30  # finished by the drain
        queued = asyncio.ensure_future(_final(engine, PROMPTS[0], _greedy(), "b"))
        await asyncio.sleep(0.1)
        assert not queued.done()  # waits while the engine sleeps
        await engine.wake_up(tags=["weights"])
        assert await engine.is_sleeping()
        await engine.wake_up(tags=["kv_cache"])
        assert not await engine.is_sleeping()
        return await queued

    assert asyncio.run(main()).outputs[0].token_ids == want
    engine.shutdown()


def test_enable_log_requests_logs_adds_and_aborts(tiny_qwen2, caplog) -> None:
    engine = _engine(tiny_qwen2, enable_log_requests=True)

    async def main():
        await _final(engine, PROMPTS[0], _greedy(), "logged")
        await engine.abort("gone")

    with caplog.at_level("INFO", logger="pagedlm.engine.async_llm"):
        asyncio.run(main())
    assert "Added request logged" in caplog.text and "Aborted request(s) gone" in caplog.text
    engine.shutdown()
    quiet = _engine(tiny_qwen2)
    caplog.clear()
    with caplog.at_level("INFO", logger="pagedlm.engine.async_llm"):
        asyncio.run(_final(quiet, PROMPTS[0], _greedy(), "quiet"))
    assert "Added request" not in caplog.text
    quiet.shutdown()
