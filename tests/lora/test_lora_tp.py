"""LoRA under tensor_parallel_size=2 (two worker processes): A/B sharded as vLLM shards them
(column-parallel layers split B's rows, row-parallel ones A's columns, the shrink all-reduced);
a mixed batch equals transformers with each adapter merged, including replicated KV heads."""

from __future__ import annotations

from pathlib import Path

from pagedlm import LLM
from pagedlm.lora.request import LoRARequest
from tests.lora.peft_utils import make_adapter, random_prompts
from tests.lora.test_lora_oracle import check_outputs, generate


def _run(model: Path, adapters: list[Path | None], prompts, **kwargs):
    distinct = list(dict.fromkeys(a for a in adapters if a is not None))
    requests = {a: LoRARequest(f"lora{i}", i + 1, str(a)) for i, a in enumerate(distinct)}
    llm = LLM(
        str(model),
        dtype="float32",
        max_model_len=256,
        enable_lora=True,
        max_lora_rank=8,
        tensor_parallel_size=2,
        **kwargs,
    )
    try:
        return generate(llm, prompts, [requests.get(a) for a in adapters])
    finally:
        llm.llm_engine.shutdown()


def test_tp2_mixed_batch(tiny_qwen2, qwen2_adapters, tmp_path_factory) -> None:
    a1, a2, a3 = (qwen2_adapters[k] for k in ("a1", "a2", "a3"))
    prompts = random_prompts([3, 17, 150, 25, 9])
    adapters = [a1, None, a3, a2, a1]
    outputs = _run(tiny_qwen2, adapters, prompts, max_loras=3)
    check_outputs(outputs, prompts, adapters, tiny_qwen2, tmp_path_factory)


def test_tp2_replicated_kv_heads_lru(tiny_model_factory, tmp_path_factory) -> None:
    model = tiny_model_factory("llama", num_key_value_heads=1)  # each rank holds the KV head
    root = tmp_path_factory.mktemp("llama-adapters")
    b1 = make_adapter(model, root / "b1", r=8, alpha=16, seed=11)
    b2 = make_adapter(model, root / "b2", r=4, alpha=8, seed=12, targets=["k_proj", "v_proj"])
    prompts = random_prompts([20, 6, 33], seed=2)
    adapters = [b1, b2, b1]
    outputs = _run(model, adapters, prompts, max_loras=1, max_cpu_loras=1)
    check_outputs(outputs, prompts, adapters, model, tmp_path_factory)
