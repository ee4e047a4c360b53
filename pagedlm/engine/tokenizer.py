"""Load the tokenizer of a model (Hugging Face AutoTokenizer), or none with skip_tokenizer_init."""

from __future__ import annotations

from typing import Any

from pagedlm import envs
from pagedlm.config import ModelConfig


def load_tokenizer(model_config: ModelConfig) -> Any:
    if model_config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    if model_config.tokenizer.endswith(".gguf"):
        from pagedlm.model_loader.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(model_config.tokenizer, envs.cache_dir())
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


def get_tokenizer(
    tokenizer_name: str,
    *args: Any,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    **kwargs: Any,
) -> Any:
    """vLLM's `get_tokenizer`: a Hugging Face tokenizer by directory, hub id or .gguf file.

    Extra keyword arguments (e.g. `add_bos_token`) go to `AutoTokenizer.from_pretrained`.
    """
    if tokenizer_mode not in ("auto", "hf", "slow"):
        raise NotImplementedError(
            f"tokenizer_mode={tokenizer_mode!r} is not supported by pagedlm (auto, hf, slow)."
        )
    if str(tokenizer_name).endswith(".gguf"):
        from pagedlm.model_loader.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(str(tokenizer_name), envs.cache_dir())
    from transformers import AutoTokenizer

    kwargs.setdefault("use_fast", tokenizer_mode != "slow")
    return AutoTokenizer.from_pretrained(
        tokenizer_name,
        *args,
        revision=revision,
        trust_remote_code=trust_remote_code,
        cache_dir=download_dir,
        **kwargs,
    )
