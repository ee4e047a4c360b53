"""Load the tokenizer of a model (Hugging Face AutoTokenizer), or none with skip_tokenizer_init."""

from __future__ import annotations

import json
from pathlib import Path
from types import CodeType
from typing import Any

from pagedlm import envs
from pagedlm.config import ModelConfig

# model types whose tokenizers transformers' Mistral regex check is about
_MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


# what transformers 5's tokenizers-backed classes keep of the vocabulary they built their Rust
# tokenizer from (Qwen2: a dict of 151936 strings and a list of 151387 merges, ~60 MB)
_CONSTRUCTION_COPIES = ("_vocab", "_merges")


def load_tokenizer(model_config: ModelConfig) -> Any:
    if model_config.skip_tokenizer_init:
        return None
    try:
        tokenizer = get_tokenizer(
            model_config.tokenizer,
            tokenizer_mode=model_config.tokenizer_mode,
            trust_remote_code=model_config.trust_remote_code,
            revision=model_config.tokenizer_revision,
        )
        drop_construction_copies(tokenizer)
        return tokenizer
    except NotImplementedError:
        raise
    except Exception as e:
        raise OSError(
            f"Could not load a tokenizer from {model_config.tokenizer!r} ({e}). Pass "
            "tokenizer=<directory with tokenizer files>, or skip_tokenizer_init=True and "
            "token-id prompts."
        ) from e


def drop_construction_copies(tokenizer: Any) -> None:
    """Drop the Python copies of the vocabulary a tokenizer's constructor built its Rust
    tokenizer from, where no method of its class but a constructor reads them (Whisper's
    save_vocabulary does: kept there)."""
    names = {n for n in _CONSTRUCTION_COPIES if isinstance(vars(tokenizer).get(n), (dict, list))}
    if names and not any(_reads(cls, names) for cls in type(tokenizer).__mro__):
        for name in names:
            setattr(tokenizer, name, None)


def _reads(cls: type, names: set[str]) -> bool:
    """Whether a method of `cls` other than `__init__` refers to an attribute in `names`."""

    def refers(code: CodeType) -> bool:
        inner = (c for c in code.co_consts if isinstance(c, CodeType))
        return not names.isdisjoint(code.co_names) or any(refers(c) for c in inner)

    for attr, value in vars(cls).items():
        code = getattr(getattr(value, "__func__", value), "__code__", None)
        if attr != "__init__" and isinstance(code, CodeType) and refers(code):
            return True
    return False


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
    for key, value in mistral_regex_kwargs(str(tokenizer_name)).items():
        kwargs.setdefault(key, value)
    return AutoTokenizer.from_pretrained(
        tokenizer_name,
        *args,
        revision=revision,
        trust_remote_code=trust_remote_code,
        cache_dir=download_dir,
        **kwargs,
    )


def mistral_regex_kwargs(tokenizer_path: str) -> dict[str, bool]:
    """`fix_mistral_regex=False` where transformers' Mistral regex warning is false.

    transformers 4.57.3-4.57.x warns that any local tokenizer next to a config.json it wrote
    has Mistral's "incorrect regex", whatever the model, and with the flag would replace the
    pre-tokenizer by Mistral's. For other models both are wrong (Qwen2.5: 86 of pagedlm's 135
    source files tokenize differently with the "fix"; Gemma 3's loader crashes), so pagedlm
    answers False for them; Mistral models keep transformers' own choice.
    """
    import transformers
    from packaging.version import Version

    if not Version("4.57.3") <= Version(transformers.__version__) < Version("5"):
        return {}
    try:
        config = json.loads((Path(tokenizer_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    model_type = config.get("model_type")
    if model_type is None or model_type in _MISTRAL_TYPES:
        return {}
    return {"fix_mistral_regex": False}
