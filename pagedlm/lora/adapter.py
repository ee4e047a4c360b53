"""PEFT LoRA adapter directories: read `adapter_config.json` + `adapter_model.safetensors` (or
`adapter_model.bin`), validate them against the model, and cut this rank's part.

A loaded `LoRAModel` holds, per target layer of the model, one (A [r, in], B [out, r]) pair per
slice (None where the adapter does not target that slice), already sharded for this
tensor-parallel rank, cast to the model dtype, with the scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora) folded into B. Every problem is a ValueError that names
the adapter and says what to do.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedlm.lora.layers import PACKED_TARGETS, SUPPORTED_TARGETS, LoRALayer
from pagedlm.lora.request import LoRARequest

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
_SLICE_OF = {leaf: fused for fused, leaves in PACKED_TARGETS.items() for leaf in leaves}


@dataclass
class LoRAModel:
    lora_int_id: int
    lora_name: str
    rank: int
    weights: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]  # layer -> per slice


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _fail(request: LoRARequest, message: str) -> ValueError:
    """A ValueError naming the adapter; terminal colour codes of a library's message dropped."""
    message = _ANSI_ESCAPE.sub("", message)
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {message}")


def read_adapter_config(request: LoRARequest) -> dict:
    path = Path(request.lora_path)
    if not path.is_dir():
        raise _fail(request, "no such directory; pass the path of a PEFT adapter directory.")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise _fail(request, "no adapter_config.json; is this a PEFT LoRA adapter directory?")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise _fail(request, f"unreadable adapter_config.json ({e}).") from e
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(request, f"peft_type {peft_type} is not supported (only LORA adapters).")
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
    }
    for key, what in refused.items():
        if config.get(key):
            raise _fail(request, f"{what} are not supported by pagedlm; use a plain LoRA.")
    if config.get("bias", "none") != "none":
        raise _fail(request, f"bias={config['bias']!r} is not supported (only bias='none').")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(SUPPORTED_TARGETS))
        if unknown:
            raise _fail(
                request,
                f"target modules {unknown} are not supported; pagedlm runs LoRA on "
                f"{', '.join(SUPPORTED_TARGETS)}. Retrain the adapter on those modules.",
            )
    return config


def _read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    path = Path(request.lora_path)
    st, binary = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st), device="cpu")
        if binary.is_file():
            return torch.load(str(binary), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt file: say which adapter
        raise _fail(request, f"cannot read the adapter weights ({type(e).__name__}: {e}).") from e
    raise _fail(request, "no adapter_model.safetensors (or adapter_model.bin) in the directory.")


def load_lora_model(
    request: LoRARequest,
    layers: dict[str, LoRALayer],
    max_lora_rank: int,
    dtype: torch.dtype,
) -> LoRAModel:
    """Read, validate and shard one adapter for the model whose LoRA layers are `layers`."""
    config = read_adapter_config(request)
    tensors = _read_tensors(request)
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (layer, slice) -> {A, B}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise _fail(
                request,
                f"tensor {key!r} is not a LoRA A/B weight (embedding LoRAs, biases and "
                "modules_to_save are not supported).",
            )
        module = match["module"]
        parent, _, leaf = module.rpartition(".")
        if leaf not in SUPPORTED_TARGETS:
            raise _fail(
                request,
                f"target module {leaf!r} ({module}) is not supported; pagedlm runs LoRA on "
                f"{', '.join(SUPPORTED_TARGETS)}.",
            )
        layer_name = f"{parent}.{_SLICE_OF.get(leaf, leaf)}" if parent else leaf
        if layer_name not in layers:
            raise _fail(
                request,
                f"module {module!r} does not exist in this model; was the adapter trained "
                "for another base model?",
            )
        pairs.setdefault((layer_name, leaf), {})[match["ab"]] = tensor
    if not pairs:
        raise _fail(request, "the adapter has no LoRA weights.")
    rank = max(p["A"].shape[0] for p in pairs.values() if "A" in p)
    if rank > max_lora_rank:
        raise _fail(
            request,
            f"rank {rank} is above max_lora_rank={max_lora_rank}; pass "
            f"LLM(..., max_lora_rank={rank}) (or larger).",
        )
    alpha = float(config.get("lora_alpha", config.get("r", rank)))
    weights: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
    for (layer_name, leaf), pair in pairs.items():
        layer = layers[layer_name]
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"{layer_name} ({leaf}) has lora_A or lora_B but not both.")
        index = next(i for i, s in enumerate(layer.slices) if s.name == leaf)
        spec = layer.slices[index]
        a, b = pair["A"], pair["B"]
        r = a.shape[0]
        if a.dim() != 2 or a.shape[1] != layer.ckpt_cols or b.shape != (spec.ckpt_rows, r):
            raise _fail(
                request,
                f"{layer_name} ({leaf}): lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                f"not match the model (expected [r, {layer.ckpt_cols}] / "
                f"[{spec.ckpt_rows}, r]); was the adapter trained for another base model?",
            )
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        a = a[:, layer.in_start : layer.in_start + layer.in_size]
        b = b[spec.ckpt_start : spec.ckpt_start + spec.out_size] * scale
        slices = weights.setdefault(layer_name, [None] * len(layer.slices))
        slices[index] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoRAModel(request.lora_int_id, request.lora_name, rank, weights)
