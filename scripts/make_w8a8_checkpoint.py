"""Write a bf16/fp32 Hugging Face directory as a compressed-tensors int8 W8A8 checkpoint, in
the layout llm-compressor's W8A8 recipe writes for vLLM: every linear weight of the decoder
layers as int8 `weight` (symmetric, per output channel) with its `weight_scale` [N, 1] in the
checkpoint's dtype; input activations declared dynamic per token; `lm_head` unquantized.

    .venv/bin/python scripts/make_w8a8_checkpoint.py SRC_DIR OUT_DIR

Dequantized (q * scale) the weights are what `quantization="int8"` computes with.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedlm.layers.quantization.int8 import quantize_per_channel  # noqa: E402

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
                "group_size": None,
                "observer": "minmax",
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
                "observer": None,
            },
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's projection (embeddings, norms and the LM head are not)."""
    return ".layers." in name and name.endswith(".weight") and tensor.dim() == 2


def write_w8a8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{src} has no .safetensors files")
    scales: dict[str, str] = {}  # weight_scale name -> its file
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensor = f.get_tensor(name)
                if is_linear_weight(name, tensor):
                    q, scale = quantize_per_channel(tensor)
                    out[name] = q
                    out[name + "_scale"] = scale[:, None].to(tensor.dtype)
                    scales[name + "_scale"] = file.name
                else:
                    out[name] = tensor
        save_file(out, dst / file.name, metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update(scales)
        (dst / index.name).write_text(json.dumps(data, indent=2))
    for path in src.iterdir():  # tokenizer, generation config, chat template ...
        if path.is_file() and path.suffix != ".safetensors" and path.name != index.name:
            shutil.copy(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a Hugging Face directory of bf16/fp32 safetensors")
    parser.add_argument("out", help="the directory to write")
    args = parser.parse_args(argv)
    print(write_w8a8_checkpoint(args.src, args.out), file=sys.stderr)


if __name__ == "__main__":
    main()
