"""Write a GGUF model (a file or a packaged name) as a Hugging Face directory.

The tensors are dequantized by pagedlm's GGUF loader and saved as bf16 safetensors with the
config and tokenizer, so transformers, vLLM and pagedlm can all read the same weights:

    .venv/bin/python scripts/gguf_to_hf.py qwen2.5-coder-0.5b-instruct OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedlm import envs  # noqa: E402
from pagedlm.model_loader.catalog import resolve_packaged_model  # noqa: E402
from pagedlm.model_loader.gguf_loader import (  # noqa: E402
    iterate_gguf,
    load_gguf_config,
    load_gguf_tokenizer,
)


def convert(model: str, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    path = resolve_packaged_model(model) or Path(model)
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    start = time.time()
    config = load_gguf_config(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in iterate_gguf(path, config):
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        tensors[name] = tensor.to(dtype).contiguous()
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(out_dir / "model.safetensors")
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(out_dir)
    tokenizer = load_gguf_tokenizer(path, envs.cache_dir())
    tokenizer.save_pretrained(out_dir)
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    eos = [e for e in eos if e is not None and e != tokenizer.unk_token_id]
    if eos:
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    print(f"wrote {out_dir} in {time.time() - start:.0f}s")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="packaged model name or .gguf path")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = parser.parse_args()
    convert(args.model, args.out_dir, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
