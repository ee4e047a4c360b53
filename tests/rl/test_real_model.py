"""The control plane on the packaged 0.5B model (GGUF, tied embeddings): dequantized (bf16)
weights take updates and level-2 sleep; packed GGUF weights refuse both clearly."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.models.weight_reload import current_dense

pytestmark = pytest.mark.slow
MODEL = "qwen2.5-coder-0.5b-instruct"
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
PROMPT = "def fibonacci(n):"
NAME = "model.layers.3.mlp.down_proj.weight"


def run(llm: LLM):
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [d[t].logprob for d, t in zip(out.logprobs, out.token_ids, strict=True)]


def test_dequantized_real_model_sleeps_reloads_and_updates(monkeypatch):
    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", "1")
    llm = LLM(MODEL, enable_sleep_mode=True, max_model_len=1024)
    before = run(llm)
    llm.sleep(level=2)
    assert llm.wake_up() is True
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.collective_rpc("reload_weights")
    assert run(llm) == before
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    layer = model.get_submodule(NAME.removesuffix(".weight"))
    dense = current_dense(layer, layer.weight, (896, 4864))  # from its compute layout
    model.load_weights([(NAME, torch.zeros_like(dense))])
    assert run(llm) != before
    model.load_weights([(NAME, dense)])
    assert run(llm) == before


def test_packed_gguf_weights_refuse_updates_and_level2(monkeypatch):
    monkeypatch.delenv("PAGEDLM_GGUF_DEQUANTIZE", raising=False)
    llm = LLM(MODEL, enable_sleep_mode=True, max_model_len=1024)
    before = run(llm)
    with pytest.raises(ValueError, match="held quantized"):
        llm.apply_model(lambda m: m.load_weights([(NAME, torch.zeros(896, 4864))]))
    with pytest.raises(NotImplementedError, match="quantized weights"):
        llm.sleep(level=2)
    assert not llm.is_sleeping()
    llm.sleep(level=1)
    assert llm.wake_up() is True
    assert run(llm) == before
