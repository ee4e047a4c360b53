"""Multi-LoRA serving against transformers with each PEFT adapter merged (fp32, greedy): one
mixed batch of three adapters and the base model, LRU eviction through one slot, and prefix
caching that never shares KV between adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.lora.request import LoRARequest
from pagedlm.platforms import current_platform
from tests.lora.peft_utils import make_adapter, merged_model, random_prompts
from tests.models.test_models_vs_hf import hf_reference

MAX_TOKENS = 6
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0
)
_REFS: dict[tuple, list] = {}


def reference(base: Path, adapter: Path | None, prompts, tmp_path_factory) -> list:
    key = (str(base), str(adapter), tuple(map(tuple, prompts)))
    if key not in _REFS:
        merged = merged_model(base, adapter, tmp_path_factory.mktemp("merged"))
        _REFS[key] = hf_reference(merged, prompts, MAX_TOKENS)
    return _REFS[key]


def check_outputs(outputs, prompts, adapters, base, tmp_path_factory) -> None:
    """Each output equals transformers with its adapter merged (None: the base model)."""
    for name in set(adapters):
        rows = [i for i, a in enumerate(adapters) if a == name]
        want = reference(base, name, [prompts[i] for i in rows], tmp_path_factory)
        for i, (tokens, logprobs, prompt_logprobs) in zip(rows, want, strict=True):
            completion = outputs[i].outputs[0]
            assert list(completion.token_ids) == tokens, (i, name)
            got = [completion.logprobs[j][t].logprob for j, t in enumerate(tokens)]
            assert got == pytest.approx(logprobs, abs=1e-4)
            if outputs[i].prompt_logprobs is None:
                continue
            got_prompt = [
                lp[t].logprob
                for lp, t in zip(outputs[i].prompt_logprobs[1:], prompts[i][1:], strict=True)
            ]
            assert got_prompt == pytest.approx(prompt_logprobs, abs=1e-4)


def generate(llm, prompts, loras, params=PARAMS):
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False
    )


def test_mixed_batch_of_three_adapters_and_base(
    tiny_qwen2, qwen2_adapters, tmp_path_factory, monkeypatch
) -> None:
    a1, a2, a3 = (qwen2_adapters[k] for k in ("a1", "a2", "a3"))
    # the MLP runs the prefill in row chunks of 64, across requests of different adapters
    monkeypatch.setattr(type(current_platform), "dense_chunk_rows", 64)
    prompts = random_prompts([3, 17, 40, 150, 9, 25, 60, 5])
    adapters = [None, a1, a2, a3, a1, None, a3, a2]
    requests = {a: LoRARequest(Path(a).name, i + 1, str(a)) for i, a in enumerate((a1, a2, a3))}
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=256,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
    )
    loras = [requests.get(a) for a in adapters]
    outputs = generate(llm, prompts, loras)
    check_outputs(outputs, prompts, adapters, tiny_qwen2, tmp_path_factory)
    assert [o.lora_request for o in outputs] == loras
    # the adapters change the model: the test above could fail
    base = reference(tiny_qwen2, None, prompts, tmp_path_factory)
    for i, a in enumerate(adapters):
        if a is not None:
            assert (
                outputs[i].prompt_logprobs[1:]
                and max(
                    abs(lp[t].logprob - w)
                    for lp, t, w in zip(
                        outputs[i].prompt_logprobs[1:], prompts[i][1:], base[i][2], strict=True
                    )
                )
                > 1e-2
            )
    assert llm.llm_engine.list_loras() == {1, 2, 3}


def test_steps_without_adapters_select_output_rows(
    tiny_qwen2, qwen2_adapters, tmp_path_factory, monkeypatch
) -> None:
    """With LoRA enabled, a step whose requests use no adapter computes the last layer for
    its output rows only; a step with one computes every row. Both match transformers."""
    import pagedlm.worker.model_runner as model_runner

    selected = []
    original = model_runner.build_step_inputs

    def spy(*args, **kwargs):
        inputs = original(*args, **kwargs)
        selected.append(inputs.output_rows is not None)
        return inputs

    monkeypatch.setattr(model_runner, "build_step_inputs", spy)
    a1 = qwen2_adapters["a1"]
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompts = random_prompts([9, 30, 17], seed=5)
    for adapter in (None, a1):
        selected.clear()
        lora = LoRARequest("a1", 1, str(a1)) if adapter else None
        outputs = generate(llm, prompts, [lora] * len(prompts), params)
        check_outputs(outputs, prompts, [adapter] * len(prompts), tiny_qwen2, tmp_path_factory)
        assert selected[0] is (adapter is None) and not any(selected[1:])  # decodes: whole


def test_lru_eviction_one_slot_two_cached_with_preemption(
    tiny_qwen2, qwen2_adapters, tmp_path_factory
) -> None:
    names = ["a1", "a2", "a3", "a4"]
    paths = [qwen2_adapters[n] for n in names]
    requests = [
        LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(zip(names, paths, strict=True))
    ]
    prompts = random_prompts([60, 62, 61, 63, 60, 62, 61, 63], seed=3)
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=8,
        # chunked prefills and preemptions (8 blocks of 16 tokens) along the way
        block_size=16,
        num_gpu_blocks_override=8,
        max_num_batched_tokens=16,
    )
    outputs = generate(llm, prompts, [requests[i % 4] for i in range(8)])
    check_outputs(outputs, prompts, [paths[i % 4] for i in range(8)], tiny_qwen2, tmp_path_factory)
    assert len(llm.llm_engine.list_loras()) == 2
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_prefix_cache_is_per_adapter(tiny_qwen2, qwen2_adapters, tmp_path_factory) -> None:
    a1, a2 = qwen2_adapters["a1"], qwen2_adapters["a2"]
    r1, r2 = LoRARequest("a1", 1, str(a1)), LoRARequest("a2", 2, str(a2))
    prompt = random_prompts([40], seed=5)
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=256,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        enable_prefix_caching=True,
        block_size=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)

    def run(lora):
        out = llm.generate([{"prompt_token_ids": prompt[0]}], params, lora_request=lora)[0]
        return out.num_cached_tokens, list(out.outputs[0].token_ids)

    first = run(r1)
    other = run(r2)
    base = run(None)
    again = run(r1)
    assert first[0] == 0 and other[0] == 0 and base[0] == 0  # nothing shared across adapters
    assert again[0] == 32  # the same adapter reuses its two full prompt blocks
    for (_, tokens), adapter in ((first, a1), (other, a2), (base, None), (again, a1)):
        assert tokens == reference(tiny_qwen2, adapter, prompt, tmp_path_factory)[0][0]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_other_architectures(arch, tiny_model_factory, tmp_path_factory) -> None:
    if arch == "gemma3":
        from tests.models.test_gemma3 import make_tiny_gemma3

        model = make_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))
    else:
        model = tiny_model_factory(arch)
    adapter = make_adapter(model, tmp_path_factory.mktemp(f"{arch}-lora"), r=8, alpha=8, seed=21)
    prompts = random_prompts([11, 37, 4], seed=9)
    adapters = [adapter, None, adapter]
    llm = LLM(str(model), dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8)
    request = LoRARequest("x", 7, str(adapter))
    outputs = generate(llm, prompts, [request if a else None for a in adapters])
    check_outputs(outputs, prompts, adapters, model, tmp_path_factory)


def test_pytorch_bin_adapter_and_beam_search(tiny_qwen2, qwen2_adapters, tmp_path) -> None:
    """adapter_model.bin loads like the safetensors file; beam search takes one adapter per
    prompt."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from pagedlm.sampling_params import BeamSearchParams

    src = Path(qwen2_adapters["a1"])
    binary = tmp_path / "a1-bin"
    binary.mkdir()
    shutil.copy(src / "adapter_config.json", binary)
    torch.save(load_file(str(src / "adapter_model.safetensors")), binary / "adapter_model.bin")
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    st, bn = LoRARequest("st", 1, str(src)), LoRARequest("bin", 2, str(binary))
    prompts = random_prompts([9, 21], seed=4)
    outs = generate(llm, prompts * 2, [st, st, bn, bn])
    for a, b in zip(outs[:2], outs[2:], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob)
    beams = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=2, max_tokens=3),
        lora_request=[st, None],
    )
    assert [b.sequences[0].lora_request for b in beams] == [st, None]


def test_gguf_base_model(tiny_llama, tmp_path_factory) -> None:
    """Adapters apply on a GGUF base (linear method "gguf"); F32 GGUF: exact."""
    pytest.importorskip("gguf")
    from tests.gguf_writer import write_llama_gguf

    path = write_llama_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    adapter = make_adapter(tiny_llama, tmp_path_factory.mktemp("llama-lora"), r=4, seed=31)
    prompts = random_prompts([14, 30], seed=6)
    llm = LLM(
        str(path),
        tokenizer=str(tiny_llama),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_lora_rank=8,
    )
    assert llm.llm_engine.vllm_config.model_config.quantization == "gguf"
    outputs = generate(llm, prompts, [LoRARequest("g", 1, str(adapter)), None])
    check_outputs(outputs, prompts, [adapter, None], tiny_llama, tmp_path_factory)


@pytest.mark.parametrize("kwargs", [{"dtype": "bfloat16"}, {"quantization": "int8"}])
def test_bf16_and_int8_base_close_to_fp32_reference(
    kwargs, tiny_qwen2, qwen2_adapters, tmp_path_factory
) -> None:
    """Low-precision bases: the LoRA delta is computed in the activation dtype; prompt logprobs
    stay close to the fp32 merged reference (and the adapter is applied: base differs more)."""
    adapter = qwen2_adapters["a1"]
    prompts = random_prompts([30], seed=8)
    llm = LLM(
        str(tiny_qwen2),
        max_model_len=128,
        enable_lora=True,
        max_lora_rank=8,
        **{"dtype": "float32", **kwargs},
    )
    out = generate(llm, prompts, [LoRARequest("a1", 1, str(adapter))])[0]
    got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompts[0][1:], strict=True)]
    want = reference(tiny_qwen2, adapter, prompts, tmp_path_factory)[0][2]
    base = reference(tiny_qwen2, None, prompts, tmp_path_factory)[0][2]
    err = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert err < 0.05 and err < max(abs(a - b) for a, b in zip(got, base, strict=True))
