"""Iterate (name, tensor) pairs from a Hugging Face directory: `*.safetensors` files, else
PyTorch `pytorch_model*.bin` files, read as vLLM reads them (`torch.load(weights_only=True)`:
tensors only, never arbitrary unpickling)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedlm.utils import mapped_ranges, release_mapped_pages


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
            f"No *.safetensors or pytorch_model*.bin files in {model_dir}. pagedlm loads "
            "Hugging Face checkpoints in those formats, or GGUF files."
        )
    return files


def _pt_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("pytorch_model*.bin"))


def iterate_safetensors(
    model_dir: str | Path, load_format: str = "auto"
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors: its safetensors shards, or its PyTorch .bin shards when it
    has no safetensors (`load_format` "safetensors" / "pt" insists on one kind, as vLLM)."""
    from safetensors import SafetensorError, safe_open

    model_dir = Path(model_dir)
    pt_files = _pt_files(model_dir)
    has_safetensors = any(model_dir.glob("*.safetensors"))
    wanted = {"safetensors": has_safetensors, "pt": bool(pt_files)}.get(load_format, True)
    if not wanted:
        raise ValueError(
            f"load_format={load_format!r} but {model_dir} has no "
            f"{'*.safetensors' if load_format == 'safetensors' else 'pytorch_model*.bin'} "
            "files; pass load_format='auto'."
        )
    if load_format == "pt" or (pt_files and not has_safetensors):
        yield from _iterate_pt(pt_files)
        return
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                # get_tensor copies out of safetensors' read-only mapping of the file: drop
                # the pages each copy read, so loading holds one copy of the weights, not two
                mapping = mapped_ranges(str(path))
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor = f.get_tensor(name)
                    for address, nbytes in mapping:
                        release_mapped_pages(address, nbytes)
                    yield name, tensor
        except SafetensorError as e:
            raise ValueError(
                f"{path} is not a valid safetensors file ({e}); it may be truncated or corrupt. "
                "Re-download the model."
            ) from e


def _iterate_pt(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # truncated, or a pickle that is not plain tensors
            raise ValueError(
                f"{path} is not a readable PyTorch tensor checkpoint ({type(e).__name__}: {e}); "
                "it may be truncated, or hold more than tensors (pagedlm, like vLLM, only loads "
                "weights_only checkpoints). Re-download it or convert it to safetensors."
            ) from e
        yield from state.items()
        del state
