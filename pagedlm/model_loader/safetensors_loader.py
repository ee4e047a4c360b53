"""Iterate (name, tensor) pairs from a Hugging Face directory of `*.safetensors` files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's shards: from model.safetensors.index.json if present, else a glob."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is malformed ({e}); re-download the model.") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index.name} lists shards that are missing in {model_dir}: {', '.join(missing)}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors files in {model_dir}. pagedlm loads safetensors checkpoints "
            "(or GGUF files); convert .bin checkpoints with transformers' save_pretrained."
        )
    return files


def iterate_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(
                f"{path} is not a valid safetensors file ({e}); it may be truncated or corrupt. "
                "Re-download the model."
            ) from e
