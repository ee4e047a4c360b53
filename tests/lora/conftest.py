"""Adapters shared by the LoRA tests: PEFT LoRAs of tiny_qwen2 with random non-zero weights."""

from __future__ import annotations

import pytest

from tests.lora.peft_utils import make_adapter


@pytest.fixture(scope="session")
def qwen2_adapters(tiny_qwen2, tmp_path_factory) -> dict[str, object]:
    """Four adapters: ranks 8 and 4, different alphas, all seven targets or a subset, one
    with rsLoRA scaling."""
    root = tmp_path_factory.mktemp("lora-adapters")
    specs = {
        "a1": dict(r=8, alpha=16, seed=1),
        "a2": dict(r=4, alpha=8, seed=2, targets=["q_proj", "v_proj", "gate_proj", "down_proj"]),
        "a3": dict(r=4, alpha=4, seed=3, use_rslora=True),
        "a4": dict(r=8, alpha=32, seed=4, targets=["k_proj", "o_proj", "up_proj"]),
    }
    return {name: make_adapter(tiny_qwen2, root / name, **spec) for name, spec in specs.items()}
