"""The control plane on the packaged 0.5B model (bf16, GGUF-dequantized, tied embeddings)."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams

pytestmark = pytest.mark.slow
MODEL = "qwen2.5-coder-0.5b-instruct"
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
PROMPT = "def fibonacci(n):"


def run(llm: LLM):
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]


def test_sleep_level2_reload_and_weight_update_on_real_model():
    llm = LLM(MODEL, enable_sleep_mode=True, max_model_len=1024)
    before = run(llm)
    llm.sleep(level=2)
    assert llm.wake_up() is True
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.collective_rpc("reload_weights")
    assert run(llm) == before
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    name = "model.layers.3.mlp.down_proj.weight"
    original = dict(model.named_parameters())[name]
    dense = original.data.to_dense() if original.is_mkldnn else original.data.clone()
    model.load_weights([(name, torch.zeros_like(dense))])
    assert run(llm) != before
    model.load_weights([(name, dense)])
    assert run(llm) == before
