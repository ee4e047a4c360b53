"""Shared fixtures: tiny random-weight models saved with transformers, and a tiny tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny_tokenizer import build_tiny_tokenizer

VOCAB_SIZE = 512

# The tests send callables to worker processes (collective_rpc / apply_model) on purpose; the
# opt-in itself is tested with the variable removed (test_failure_isolation.py).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def make_tiny_model(path: Path, arch: str, **overrides) -> Path:
    """Save a 2-layer, hidden-64 random model of `arch` (with the tiny tokenizer) to `path`."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    config_cls = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    config = config_cls(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init give less flat distributions
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def factory(arch: str = "qwen2", **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(path, arch, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen2")
