"""The decode plan (models/llama_decode_plan.py) replays the modules' own kernel calls, so a
generation with it equals one without it bit for bit: same tokens, same logprobs. Checked on a
tiny llama GGUF whose projections are all packed (mixed types, fused q/k/v of two types), on
the int8 one, and on the dense checkpoint in bf16 (the small-batch kernels: blocked for AVX-512
BF16, dense for AMX and AVX2) and fp32 (oneDNN), for 1 to 6 sequences per step; the plan
notices replaced tensors; other linear paths run the modules."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.layers.quantization.gguf import GEMV_ROWS, takes_gemv
from pagedlm.models.llama_decode_plan import MAX_ROWS, LlamaDecodePlan
from tests.e2e.test_quantized_models import mixed_gguf  # noqa: F401 (fixture)
from tests.e2e.test_tensor_parallel import _prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


def _runner(llm: LLM):
    return llm.llm_engine.model_executor.driver_worker.model_runner


def _generate(model, tokenizer, max_num_seqs: int, dtype: str, **kwargs) -> list:
    llm = LLM(
        str(model),
        tokenizer=str(tokenizer),
        max_model_len=128,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        **kwargs,
    )
    try:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        outs = [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    logprobs = [[{t: lp.logprob for t, lp in d.items()} for d in o.logprobs] for o in outs]
    return [(o.token_ids, lps) for o, lps in zip(outs, logprobs, strict=True)]


@pytest.mark.parametrize(
    "source,dtype",
    [
        ("gguf", "float32"),
        ("gguf", "bfloat16"),
        ("dense", "bfloat16"),
        ("dense", "float32"),
        ("int8", "bfloat16"),
    ],
)
@pytest.mark.parametrize("max_num_seqs", [1, 3, 6])
def test_decode_plan_equals_modules(
    tiny_llama,
    mixed_gguf,  # noqa: F811
    monkeypatch,
    max_num_seqs,
    source,
    dtype,
) -> None:
    model = mixed_gguf if source == "gguf" else tiny_llama
    kwargs = {"quantization": "int8"} if source == "int8" else {}
    rows_seen: list[int] = []
    run = LlamaDecodePlan.run

    def counting_run(self, *args):
        rows_seen.append(self.rows)
        return run(self, *args)

    monkeypatch.setattr(LlamaDecodePlan, "run", counting_run)
    with_plan = _generate(model, tiny_llama, max_num_seqs, dtype, **kwargs)
    # the plan ran, at every batch size it replays (packed weights where neither the VNNI GEMM
    # nor the AVX2 GEMV runs: up to GEMV_ROWS)
    integer = cpu_kernels().gguf_gemm_compiled() or takes_gemv(MAX_ROWS)
    cap = MAX_ROWS if source == "dense" or integer else GEMV_ROWS
    assert rows_seen
    assert max(rows_seen) == max_num_seqs if max_num_seqs <= cap else max(rows_seen) <= cap
    rows_seen.clear()
    monkeypatch.setenv("PAGEDLM_DISABLE_DECODE_PLAN", "1")
    without = _generate(model, tiny_llama, max_num_seqs, dtype, **kwargs)
    assert not rows_seen
    assert with_plan == without


def test_decode_plan_notices_replaced_tensors(tiny_llama, mixed_gguf) -> None:  # noqa: F811
    llm = LLM(str(mixed_gguf), tokenizer=str(tiny_llama), max_model_len=128, max_num_seqs=1)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
        runner = _runner(llm)
        plan = runner._decode_plans[1]
        assert plan.current()
        layer = runner.model.model.layers[1]
        attn = layer.self_attn.attn
        cache = attn.kv_cache
        attn.kv_cache = cache.clone()  # as a re-allocation after sleep would
        assert not plan.current()
        attn.kv_cache = cache
        assert plan.current()
        norm = layer.post_attention_layernorm
        weight = norm.weight.data
        norm.weight.data = weight.clone()  # the same Parameter, new storage
        assert not plan.current()
        norm.weight.data = weight
        assert plan.current()
        norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        assert not plan.current()
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
        assert runner._decode_plans[1] is not plan and runner._decode_plans[1].current()
    finally:
        llm.llm_engine.shutdown()


def test_other_linear_paths_run_the_modules(tiny_llama, mixed_gguf) -> None:  # noqa: F811
    """A GGUF group left unpacked (a type without a packed kernel) takes the dequantizing
    path, which the plan does not replay: the model runs the modules."""
    llm = LLM(str(mixed_gguf), tokenizer=str(tiny_llama), max_model_len=128, max_num_seqs=1)
    try:
        runner = _runner(llm)
        assert LlamaDecodePlan.supports(runner.model)
        group = runner.model.model.layers[1].mlp.down_proj.packed_groups[0]
        packed, group.packed = group.packed, None
        try:
            assert not LlamaDecodePlan.supports(runner.model)
        finally:
            group.packed = packed
    finally:
        llm.llm_engine.shutdown()


def test_decode_plan_with_a_one_token_prompt_chunk(tiny_llama, mixed_gguf, monkeypatch) -> None:  # noqa: F811
    """A token budget of 2: one request decodes while the other's prompt goes in one token a
    step. Those steps are decode-shaped (every query one token) but one row is not sampled:
    the plan runs them whole, rows are selected only for queries of several rows. Then the
    other's prompt goes in chunks of two that use no row (the modules' last layer keeps one).
    Plan and modules give the same tokens and logprobs."""
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(10, 30))}]

    def generate() -> list:
        llm = LLM(
            str(mixed_gguf),
            tokenizer=str(tiny_llama),
            max_model_len=128,
            max_num_seqs=2,
            max_num_batched_tokens=2,
            dtype="float32",
        )
        try:
            outs = [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
        return [
            (o.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs])
            for o in outs
        ]

    subsets: list[int] = []
    run = LlamaDecodePlan.run

    def counting_run(self, input_ids, *args):
        subsets.append(input_ids.shape[0])
        return run(self, input_ids, *args)

    monkeypatch.setattr(LlamaDecodePlan, "run", counting_run)
    with_plan = generate()
    assert subsets.count(2) >= 10  # A decoding beside B's prompt tokens, one a step
    monkeypatch.setenv("PAGEDLM_DISABLE_DECODE_PLAN", "1")
    assert generate() == with_plan
