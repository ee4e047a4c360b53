"""Load the tokenizer of a model (Hugging Face AutoTokenizer), or none with skip_tokenizer_init."""

from __future__ import annotations

from typing import Any

from pagedlm.config import ModelConfig


def load_tokenizer(model_config: ModelConfig) -> Any:
    if model_config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    if model_config.tokenizer.endswith(".gguf"):
        from pagedlm.model_loader.catalog import cache_dir
        from pagedlm.model_loader.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(model_config.tokenizer, cache_dir())
    try:
        return AutoTokenizer.from_pretrained(
            model_config.tokenizer,
            revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code,
            use_fast=model_config.tokenizer_mode != "slow",
        )
    except Exception as e:
        raise OSError(
            f"Could not load a tokenizer from {model_config.tokenizer!r} ({e}). Pass "
            "tokenizer=<directory with tokenizer files>, or skip_tokenizer_init=True and "
            "token-id prompts."
        ) from e
