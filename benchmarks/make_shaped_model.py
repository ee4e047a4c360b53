"""Write a random-weight Hugging Face directory with the shapes of a Qwen2.5 model (0.5B, 1.5B,
3B), the default model's tokenizer and bf16 weights, for speed and memory measurements at
the sizes people run (speed does not depend on the values; run with ignore_eos):

    .venv/bin/python benchmarks/make_shaped_model.py 1.5b OUT_DIR

Weights are N(0, 0.02) (norms 1, biases 0), written shard by shard (2 GB each), so making the
3B directory needs little more memory than one shard.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import default_model  # noqa: E402

# Qwen2.5's published configs: hidden, intermediate, layers, attention heads, KV heads
SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (2048, 11008, 36, 16, 2),
}
SHARD_BYTES = 2 << 30


def tensors(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int):
    """(name, shape, kind) in checkpoint order; kind: "w" random, "one", "zero"."""
    head_dim = hidden // heads
    yield "model.embed_tokens.weight", (vocab, hidden), "w"
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,), "one"
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            yield p + f"self_attn.{name}_proj.weight", (rows * head_dim, hidden), "w"
            yield p + f"self_attn.{name}_proj.bias", (rows * head_dim,), "zero"
        yield p + "self_attn.o_proj.weight", (hidden, hidden), "w"
        yield p + "post_attention_layernorm.weight", (hidden,), "one"
        yield p + "mlp.gate_proj.weight", (inter, hidden), "w"
        yield p + "mlp.up_proj.weight", (inter, hidden), "w"
        yield p + "mlp.down_proj.weight", (hidden, inter), "w"
    yield "model.norm.weight", (hidden,), "one"


def make_shaped_model(size: str, out: str | Path, seed: int = 0) -> Path:
    hidden, inter, layers, heads, kv_heads = SHAPES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(default_model())
    config = json.loads((source / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_window_layers=layers,
        layer_types=["full_attention"] * layers,
        tie_word_embeddings=True,  # as Qwen2.5 0.5B-3B
    )
    vocab = config["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size_now = 0
    for name, shape, kind in tensors(hidden, inter, layers, heads, kv_heads, vocab):
        if kind == "w":
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        else:
            t = (torch.ones if kind == "one" else torch.zeros)(shape, dtype=torch.bfloat16)
        if size_now + t.numel() * 2 > SHARD_BYTES and shards[-1]:
            shards.append({})
            size_now = 0
        shards[-1][name] = t
        size_now += t.numel() * 2
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * 2 for s in shards for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    generation = json.loads((source / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("size", choices=sorted(SHAPES))
    parser.add_argument("out")
    args = parser.parse_args()
    print(make_shaped_model(args.size, args.out))


if __name__ == "__main__":
    main()
