"""Write a Hugging Face qwen2 directory (make_shaped_model.py's, or any Qwen2/Qwen2.5 one) as
a GGUF file the way llama.cpp's converter does with `--outtype q8_0`, so pagedlm's packed
kernels and llama.cpp run the same weights as the bf16 and int8 columns of the scaling table:

    .venv/bin/python benchmarks/make_shaped_gguf.py MODEL_DIR OUT.gguf [--type Q8_0]

Matrices are stored as --type (Q8_0 or F32), norms and biases as F32; the tokenizer metadata
comes from the packaged default model's GGUF (the shaped models use its tokenizer). qwen2 has
no q/k row permutation (only llama's converter applies one). Tensors are read one at a time,
but the gguf library's writer holds the quantized file in memory until it writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
from common import ROOT, default_gguf  # noqa: E402

sys.path.insert(0, str(ROOT))
from pagedlm.model_loader.gguf_loader import gguf_tensor_name  # noqa: E402
from pagedlm.model_loader.gguf_reader import GGUFFile  # noqa: E402


def _copy_tokenizer(writer: gguf.GGUFWriter, tokenizer_gguf: str) -> None:
    """The tokenizer.* metadata of another GGUF file, value types as the converter writes."""
    for key, value in GGUFFile(tokenizer_gguf).metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:  # tokens, merges (strings), token types (int32)
            writer.add_array(key, list(value))


def make_shaped_gguf(
    model_dir: str | Path, out: str | Path, qtype: str = "Q8_0", tokenizer_gguf: str | None = None
) -> Path:
    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "qwen2":
        raise SystemExit(f"{model_dir}: model_type {config.get('model_type')!r}, not qwen2")
    matrix_type = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_name(model_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.ALL_F32
    )
    _copy_tokenizer(writer, tokenizer_gguf or default_gguf())
    files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue  # a tied file has no output.weight (llama.cpp reads token_embd)
                data = f.get_tensor(name).float().numpy()
                if data.ndim == 2 and matrix_type != gguf.GGMLQuantizationType.F32:
                    raw = gguf.quants.quantize(data, matrix_type)
                    writer.add_tensor(
                        gguf_tensor_name(name), raw, raw_shape=raw.shape, raw_dtype=matrix_type
                    )
                else:
                    writer.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=len(files) > 1)
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--type", default="Q8_0", choices=["Q8_0", "F32"])
    parser.add_argument(
        "--tokenizer-gguf", default=None, help="GGUF whose tokenizer metadata to copy"
    )
    args = parser.parse_args()
    print(make_shaped_gguf(args.model_dir, args.out, args.type, args.tokenizer_gguf))


if __name__ == "__main__":
    main()
