"""LLMEngine step API, EngineArgs on the command line, stop semantics, logprobs vs transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedlm import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedlm.engine.arg_utils import FlexibleArgumentParser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine(tiny_qwen2) -> LLMEngine:
    args = EngineArgs(model=str(tiny_qwen2), dtype="float32", max_model_len=128)
    return LLMEngine.from_engine_args(args)


def _drain(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_add_step_abort_and_duplicate_ids(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    internal = engine.add_request("a", "Hello", params)
    assert internal.startswith("a-")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "Hello", params)
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.add_request(1, "Hello", params)  # type: ignore[arg-type]
    engine.add_request("b", "World", SamplingParams(n=2, temperature=1.0, max_tokens=6))
    assert engine.get_num_unfinished_requests() == 3  # n=2 counts its children
    cumulative = engine.step()
    assert {o.request_id for o in cumulative} == {"a", "b"}  # CUMULATIVE: every step
    engine.abort_request(["b"])
    assert engine.get_num_unfinished_requests() == 1
    finished = _drain(engine)
    assert set(finished) == {"a"} and len(finished["a"].outputs[0].token_ids) == 6
    kv = engine.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks


def test_stop_strings_across_tokens_and_stop_token_ids(engine: LLMEngine) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("ref", "The quick brown fox", base)
    ref = _drain(engine)["ref"].outputs[0]
    text, ids = ref.text, list(ref.token_ids)
    # a stop string made of the text of tokens 3..5 spans token boundaries
    tok = engine.get_tokenizer()
    prefix = tok.decode(ids[:3])
    stop = tok.decode(ids[:5])[len(prefix) :]
    assert stop and stop in text
    cut = text.index(stop)
    for include in (False, True):
        p = SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        engine.add_request(f"s{include}", "The quick brown fox", p)
        out = _drain(engine)[f"s{include}"].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (text[: cut + len(stop)] if include else text[:cut])
    p = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ids[4]])
    engine.add_request("t", "The quick brown fox", p)
    out = _drain(engine)["t"].outputs[0]
    first = ids.index(ids[4])
    assert list(out.token_ids) == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ids[4]


def test_eos_and_min_tokens(tiny_qwen2) -> None:
    """Force EOS with logit_bias: it ends the request (not in text) unless min_tokens defers."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_qwen2), dtype="float32", max_model_len=128)
    )
    eos = engine.get_tokenizer().eos_token_id
    p = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0})
    engine.add_request("e", "Hello", p)
    out = _drain(engine)["e"].outputs[0]
    assert list(out.token_ids) == [eos] and out.text == ""
    assert out.finish_reason == "stop" and out.stop_reason is None
    p = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, logit_bias={eos: 100.0})
    engine.add_request("m", "Hello", p)
    out = _drain(engine)["m"].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:4]


def test_logprobs_and_prompt_logprobs_match_transformers(engine: LLMEngine, tiny_qwen2) -> None:
    prompt = list(range(10, 40))
    p = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    engine.add_request("lp", {"prompt_token_ids": prompt}, p)
    out = _drain(engine)["lp"]
    gen = list(out.outputs[0].token_ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([prompt + gen])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert 2 <= len(entry) <= 3
        token = prompt[pos]
        assert entry[token].logprob == pytest.approx(ref[pos - 1, token].item(), abs=1e-4)
        assert entry[token].rank == int((ref[pos - 1] > ref[pos - 1, token]).sum()) + 1
        top = ref[pos - 1].topk(2)
        for rank, (value, tid) in enumerate(zip(top.values, top.indices, strict=True), start=1):
            assert entry[int(tid)].logprob == pytest.approx(value.item(), abs=1e-4)
            assert entry[int(tid)].rank == rank
    for i, token in enumerate(gen):
        entry = out.outputs[0].logprobs[i]
        row = ref[len(prompt) - 1 + i]
        assert 3 <= len(entry) <= 4 and entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)


def test_engine_args_cli_roundtrip() -> None:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            "m",
            "--max_model_len",
            "1k",
            "--max-num-seqs",
            "8",
            "--block-size",
            "4",
            "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes",
            "1M",
            "--seed",
            "3",
            "--dtype",
            "float32",
            "--override-generation-config",
            '{"temperature": 0.5}',
        ]
    )
    ea = EngineArgs.from_cli_args(args)
    assert (ea.model, ea.max_model_len, ea.max_num_seqs, ea.block_size) == ("m", 1000, 8, 4)
    assert (
        ea.enable_prefix_caching is False and ea.kv_cache_memory_bytes == 2**20
    )  # K/M/G binary, k/m/g decimal
    assert ea.seed == 3 and ea.override_generation_config == {"temperature": 0.5}
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size"):
        EngineArgs(model="m", pipeline_parallel_size=2)
    for name, value in [
        ("prefix_caching_hash_algo", "xxhash"),
        ("async_scheduling", True),
        ("distributed_executor_backend", "ray"),
        ("compilation_config", {"level": 3}),
    ]:  # accepted by vLLM, refused by name here (never silently ignored)
        with pytest.raises(NotImplementedError, match=name):
            EngineArgs(model="m", **{name: value})


def test_llm_engine_example_runs(tiny_qwen2) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/llm_engine_example.py"),
            "--model",
            str(tiny_qwen2),
            "--max-model-len",
            "128",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("RequestOutput(request_id=") == 3
    assert "prompt_logprobs=[None, {" in result.stdout


def test_kv_budget_counts_the_engines_model_not_the_process(tiny_qwen2) -> None:
    """gpu_memory_utilization takes that share of RAM less this engine's model, so a process
    that already holds memory (another LLM, a dataset; vLLM's tests make several engines at
    utilizations 0.1-0.5) still gets a cache; a budget too small names what to raise."""
    held = torch.ones(2**30, dtype=torch.uint16)  # 2 GiB in this process, touched
    engines = [
        LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, gpu_memory_utilization=0.1)
        for _ in range(2)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outs = [llm.generate([[5, 6, 7]], params, use_tqdm=False) for llm in engines]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
    assert all(llm.llm_engine.cache_config.num_gpu_blocks > 8 for llm in engines)
    del held
    with pytest.raises(ValueError, match="Raise kv_cache_memory_bytes to at least"):
        LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, kv_cache_memory_bytes=1000)
    with pytest.raises(ValueError, match=r"raise gpu_memory_utilization from 1e-07 to at least"):
        LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, gpu_memory_utilization=1e-7)
    with pytest.raises(ValueError, match="Raise num_gpu_blocks_override to at least 8"):
        LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, num_gpu_blocks_override=2)
