"""Turn the `model` argument into files on disk: a local directory, a GGUF file or a hub id."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ResolvedModel:
    path: str
    tokenizer_path: str
    gguf_file: str | None = None


def resolve_model(
    model: str, revision: str | None = None, hf_token: str | None = None
) -> ResolvedModel:
    """Local directory > local .gguf file > Hugging Face hub id (through huggingface_hub)."""
    from pagedlm.model_loader.catalog import resolve_packaged_model

    packaged = resolve_packaged_model(model)
    if packaged is not None:
        return ResolvedModel(str(packaged), str(packaged), str(packaged))
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(
                f"{local} has no config.json: pass a Hugging Face model directory "
                "(config.json + *.safetensors + tokenizer files)."
            )
        return ResolvedModel(str(local), str(local))
    if local.suffix == ".gguf":
        if not local.is_file():
            raise FileNotFoundError(f"GGUF file {local} does not exist.")
        return ResolvedModel(str(local), str(local), str(local))
    if local.is_absolute() or model.startswith((".", "~")):
        raise FileNotFoundError(
            f"Model path {model} does not exist. Pass a Hugging Face model directory, a .gguf "
            "file, a hub id, or a packaged model name (qwen2.5-coder-0.5b-instruct, gemma-3-270m)."
        )
    return ResolvedModel(*([_download_from_hub(model, revision, hf_token)] * 2))


def _download_from_hub(repo_id: str, revision: str | None, hf_token: str | None) -> str:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise ImportError("huggingface_hub is needed to load models by hub id") from e
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return snapshot_download(
            repo_id, revision=revision, token=hf_token, allow_patterns=patterns
        )
    except HFValidationError as e:
        raise ValueError(
            f"{repo_id!r} is neither a local directory, a .gguf file nor a valid hub id."
        ) from e
    except Exception as e:
        raise OSError(
            f"Could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "If this machine is offline, download the model elsewhere and pass its local "
            "directory as `model`."
        ) from e


def load_hf_config(resolved: ResolvedModel, trust_remote_code: bool = False) -> Any:
    if resolved.gguf_file is not None:
        from pagedlm.model_loader.gguf_loader import load_gguf_config

        return load_gguf_config(resolved.gguf_file)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolved.path, trust_remote_code=trust_remote_code)
