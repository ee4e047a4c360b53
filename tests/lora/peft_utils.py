"""PEFT adapters on the tiny random models, and transformers references with them merged."""

from __future__ import annotations

import random
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    seed: int = 0,
    use_rslora: bool = False,
) -> Path:
    """Save a PEFT LoRA of `base_dir` with random non-zero A and B (peft zeroes B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def merged_model(base_dir: Path, adapter_dir: Path | None, out_dir: Path) -> Path:
    """The base model with the adapter merged in (merge_and_unload), saved to `out_dir`."""
    if adapter_dir is None:
        return Path(base_dir)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in lengths]
