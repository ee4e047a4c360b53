"""Write a random-weight Hugging Face directory with the shapes of Qwen2.5-VL-3B-Instruct (or a
small shape for smoke tests): its config, image processor config and chat template, the
default model's Qwen2.5 tokenizer (which has the vision tokens) and bf16 weights, for speed
and memory measurements of the image path (speed does not depend on the values):

    .venv/bin/python benchmarks/make_shaped_vl_model.py 3b OUT_DIR

Tensor names and shapes come from transformers' model built on the meta device, saved under
the published checkpoint's names (`model.*`, `visual.*`); weights are N(0, 0.02) (norms 1,
biases 0), drawn and written shard by shard (2 GB each), so little more than one shard is
ever in memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import default_model  # noqa: E402

SHARD_BYTES = 2 << 30
# Qwen2.5-VL-3B-Instruct's published config; "small" keeps its vocab, tokens and image
# geometry (so the same processor and tokenizer apply) with a few narrow layers.
SHAPES: dict[str, dict[str, dict]] = {
    "3b": {
        "text": dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
        ),
        "vision": dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
    },
    "small": {
        "text": dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=2,  # head_dim 128, as mrope_section needs
            num_key_value_heads=1,
        ),
        "vision": dict(
            depth=4, hidden_size=128, intermediate_size=256, num_heads=2, fullatt_block_indexes=[3]
        ),
    },
}
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 151655, 151656, 151652, 151653
PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}
# Qwen2-VL / Qwen2.5-VL-Instruct's chat template (images and videos as content parts)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_config(size: str):
    """A transformers `Qwen2_5_VLConfig` of `size` (Qwen2.5-VL-3B-Instruct's other fields)."""
    from transformers import Qwen2_5_VLConfig

    shape = SHAPES[size]
    layers = shape["text"]["num_hidden_layers"]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **shape["text"],
            vocab_size=151936,
            hidden_act="silu",
            max_position_embeddings=128000,
            max_window_layers=layers,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
            sliding_window=32768,
            use_sliding_window=False,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
            dtype="bfloat16",
        ),
        vision_config=dict(
            **shape["vision"],
            hidden_act="silu",
            in_channels=3,
            out_hidden_size=shape["text"]["hidden_size"],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            tokens_per_second=2,
        ),
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def checkpoint_name(name: str) -> str:
    """transformers 5's module name as the published checkpoint names it."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def tensor_specs(config) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(checkpoint name, shape, kind) of every stored tensor; kind: "w" random, "one", "zero"."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embeddings
            continue
        if p.dim() > 1:
            kind = "w"
        elif name.endswith("bias"):
            kind = "zero"
        else:  # RMSNorm weights (norm, norm1, norm2, ln_q, *_layernorm)
            kind = "one"
        yield checkpoint_name(name), tuple(p.shape), kind


def make_shaped_vl_model(size: str, out: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(size)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    files: list[tuple[str, list[str]]] = []
    total = size_now = 0

    def flush() -> None:
        nonlocal shard, size_now
        tmp = out / f"shard-{len(files)}.tmp"
        save_file(shard, tmp, metadata={"format": "pt"})
        files.append((tmp.name, list(shard)))
        shard, size_now = {}, 0

    for name, shape, kind in tensor_specs(config):
        if kind == "w":
            t = torch.randn(shape, generator=gen).mul_(0.02).to(torch.bfloat16)
        else:
            t = (torch.ones if kind == "one" else torch.zeros)(shape, dtype=torch.bfloat16)
        if size_now + t.numel() * 2 > SHARD_BYTES and shard:
            flush()
        shard[name] = t
        size_now += t.numel() * 2
        total += t.numel() * 2
    flush()
    for i, (tmp, names) in enumerate(files):  # the final names need the shard count
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (out / tmp).rename(out / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    write_processor_files(out)
    return out


def write_processor_files(out: Path) -> None:
    """Tokenizer (the default model's Qwen2.5 one), chat template, image processor config and
    generation config."""
    source = Path(default_model())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)  # the VL one is chat_template.jinja
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    generation = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("size", choices=sorted(SHAPES))
    parser.add_argument("out")
    args = parser.parse_args()
    print(make_shaped_vl_model(args.size, args.out))


if __name__ == "__main__":
    main()
