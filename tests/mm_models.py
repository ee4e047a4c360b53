"""Tiny random-weight vision-language models saved with transformers (the images oracle).

Each directory holds the model, its image processor config and the tiny tokenizer with the
model's image tokens added, and a chat template that loops over content parts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.tiny_tokenizer import build_tiny_tokenizer

QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def _redraw(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # larger weights than the default init give less flat distributions
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)


def make_tiny_qwen2_5_vl(path: Path, tie_word_embeddings: bool = False) -> Path:
    """A 2-layer Qwen2.5-VL (vision: 2 blocks, one windowed, one full) with a Pillow image
    processor of at most 64 merged tokens per image."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = build_tiny_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    start, end, image, video = tokenizer.convert_tokens_to_ids(QWEN_VL_TOKENS)
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64).save_pretrained(path)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            max_position_embeddings=1024,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _redraw(model)
    model.save_pretrained(path)
    return path


GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_TEMPLATE = QWEN_VL_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>"
)


def make_tiny_gemma3_vl(path: Path, sliding_window: int = 8) -> Path:
    """A 2-layer Gemma 3 with vision (one sliding, one global layer; 56x56 images of 16 patches
    pooled to 4 soft tokens) and a Pillow image processor."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = build_tiny_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
    boi, eoi, soft = tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS)
    tokenizer.chat_template = GEMMA3_TEMPLATE
    tokenizer.save_pretrained(path)
    Gemma3ImageProcessorPil(
        size={"height": 56, "width": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(path)
    config = Gemma3Config(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=56,
            patch_size=14,
            vision_use_head=False,
        ),
        text_config=dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=512,
            sliding_window=sliding_window,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=1024,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        mm_tokens_per_image=4,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=soft,
        eos_token_id=2,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    _redraw(model)
    model.save_pretrained(path)
    return path


def hf_greedy_generate(model, prompt_token_ids, max_tokens, **image_kwargs):
    """transformers' greedy tokens and their logprobs for one expanded prompt (with the
    model's own image inputs as keyword arguments)."""
    ids = torch.tensor([prompt_token_ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **image_kwargs,
    )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        s[0].float().log_softmax(-1)[t].item() for s, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs
