"""The Qwen2.5-VL vision encoder against Hugging Face's `model.visual` on a tiny random model:
images of several sizes (partial and multiple attention windows), two images in one call, a
two-frame input, fp32 exactly and bf16 loosely; and load_weights' name checking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pagedlm.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer


@pytest.fixture(scope="module")
def hf_visual():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=3,
            hidden_size=32,
            num_heads=2,
            intermediate_size=64,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=256,
            bos_token_id=0,
            eos_token_id=1,
            rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6]},
        ),
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    return model.model.visual


def _ours(hf_visual, dtype=torch.float32) -> Qwen2_5_VisionTransformer:
    model = Qwen2_5_VisionTransformer(hf_visual.config).to(dtype).eval()
    loaded = model.load_weights(hf_visual.state_dict().items())
    assert loaded == {name for name, _ in model.named_parameters()}
    return model


def _processed(*sizes):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    images = [  # each size's image is the same whichever call it is in
        Image.fromarray(np.random.default_rng(w * 1000 + h).integers(0, 256, (h, w, 3), np.uint8))
        for w, h in sizes
    ]
    ip = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    out = ip(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _hf(hf_visual, pixel_values, grid_thw) -> torch.Tensor:
    with torch.no_grad():
        out = hf_visual(pixel_values.to(hf_visual.dtype), grid_thw=grid_thw)
    return out.pooler_output  # the merged embeddings, as get_image_features uses


CASES = [[(100, 140)], [(56, 56)], [(224, 168)], [(100, 140), (224, 168)], [(56, 56), (100, 140)]]


@pytest.mark.parametrize("sizes", CASES, ids=lambda s: "+".join(f"{w}x{h}" for w, h in s))
def test_fp32_matches_hf(hf_visual, sizes):
    pixel_values, grid_thw = _processed(*sizes)
    ours = _ours(hf_visual)
    with torch.no_grad():
        got = ours(pixel_values, grid_thw)
    want = _hf(hf_visual, pixel_values, grid_thw)
    rows = (grid_thw.prod(-1) // 4).tolist()
    assert got.shape == (sum(rows), 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    parts = ours.split_by_image(got, grid_thw)
    assert [p.shape[0] for p in parts] == rows
    if len(sizes) > 1:  # batching images changes nothing: attention stays within each image
        for size, part in zip(sizes, parts, strict=True):
            alone_pv, alone_grid = _processed(size)
            with torch.no_grad():
                alone = ours(alone_pv, alone_grid)
            torch.testing.assert_close(part, alone, atol=1e-5, rtol=1e-5)


def test_two_frames_match_hf(hf_visual):
    grid_thw = torch.tensor([[2, 8, 12], [1, 4, 6]])
    torch.manual_seed(1)
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14)
    with torch.no_grad():
        got = _ours(hf_visual)(pixel_values, grid_thw)
    torch.testing.assert_close(got, _hf(hf_visual, pixel_values, grid_thw), atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32(hf_visual):
    pixel_values, grid_thw = _processed((100, 140), (224, 168))
    ours = _ours(hf_visual, torch.bfloat16)
    assert ours.patch_embed.proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got = ours(pixel_values, grid_thw)
    assert got.dtype == torch.bfloat16
    want = _hf(hf_visual, pixel_values, grid_thw)
    assert torch.isfinite(got).all()
    rel = (got.float() - want).norm() / want.norm()
    assert rel < 0.05, rel


def test_load_weights_rejects_unknown_and_misshapen(hf_visual):
    ours = Qwen2_5_VisionTransformer(hf_visual.config)
    before = ours.merger.ln_q.weight.detach().clone()
    with pytest.raises(ValueError, match="blocks.9.attn.qkv.weight"):
        ours.load_weights(
            [("merger.ln_q.weight", torch.zeros(32)), ("blocks.9.attn.qkv.weight", torch.zeros(1))]
        )
    torch.testing.assert_close(ours.merger.ln_q.weight, before)  # nothing copied
    with pytest.raises(ValueError, match="merger.ln_q.weight"):
        ours.load_weights([("merger.ln_q.weight", torch.zeros(31))])
