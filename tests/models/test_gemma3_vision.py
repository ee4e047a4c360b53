"""The Gemma 3 image encoder against Hugging Face's `get_image_features` on a tiny random model:
pixel values from the real (PIL) Gemma 3 image processor, one and three images per call, fp32
closely and bf16 loosely; both checkpoint spellings of the weight names; load_weights' checks."""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from pagedlm.models.gemma3_vision import Gemma3ImageEncoder, canonical_name

SIZES = [(120, 80), (56, 56), (200, 300)]  # (width, height): landscape, exact, portrait


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=56,
            patch_size=14,  # 4x4 patches, pooled 2x2 -> 4 tokens
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
        ),
        mm_tokens_per_image=4,
        boi_token_index=509,
        eoi_token_index=510,
        image_token_index=511,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    return model


def _encoder_items(hf_model) -> list[tuple[str, torch.Tensor]]:
    """The HF state dict's vision tower and projector entries, as transformers 5 names them."""
    prefixes = ("model.vision_tower.", "model.multi_modal_projector.")
    return [(n, t) for n, t in hf_model.state_dict().items() if n.startswith(prefixes)]


def _ours(hf_model, dtype=torch.float32) -> Gemma3ImageEncoder:
    model = Gemma3ImageEncoder(hf_model.config).to(dtype).eval()
    loaded = model.load_weights(_encoder_items(hf_model))
    assert loaded == {name for name, _ in model.named_parameters()}
    return model


def _processed(*sizes: tuple[int, int]) -> torch.Tensor:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = [  # each size's image is the same whichever call it is in
        Image.fromarray(np.random.default_rng(w * 1000 + h).integers(0, 256, (h, w, 3), np.uint8))
        for w, h in sizes
    ]
    ip = Gemma3ImageProcessorPil(
        size={"height": 56, "width": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    out = ip(images=images, return_tensors="pt")
    assert out["num_crops"].tolist() == [0] * len(sizes)
    return out["pixel_values"]


def _hf(hf_model, pixel_values: torch.Tensor) -> torch.Tensor:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    with torch.no_grad():
        out = hf_model.get_image_features(pixel_values)
    assert isinstance(out, BaseModelOutputWithPooling)  # 5.x: projected features in pooler_output
    return out.pooler_output


@pytest.mark.parametrize("sizes", [SIZES[:1], SIZES], ids=["one", "three"])
def test_fp32_matches_hf(hf_model, sizes):
    pixel_values = _processed(*sizes)
    assert pixel_values.shape == (len(sizes), 3, 56, 56)
    ours = _ours(hf_model)
    with torch.no_grad():
        got = ours(pixel_values)
    assert got.shape == (len(sizes), 4, 64)
    torch.testing.assert_close(got, _hf(hf_model, pixel_values), atol=1e-5, rtol=1e-5)
    if len(sizes) > 1:  # batching changes nothing: attention stays within each image
        for i, size in enumerate(sizes):
            with torch.no_grad():
                alone = ours(_processed(size))
            torch.testing.assert_close(got[i : i + 1], alone, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32(hf_model):
    pixel_values = _processed(*SIZES)
    ours = _ours(hf_model, torch.bfloat16)
    with torch.no_grad():
        got = ours(pixel_values)
    assert got.dtype == torch.bfloat16
    want = _hf(hf_model, pixel_values)
    assert torch.isfinite(got).all()
    rel = (got.float() - want).norm() / want.norm()
    assert rel < 0.05, rel
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)  # same dtype, same rounding points
    torch.testing.assert_close(got, _hf(hf_bf16, pixel_values), atol=2e-2, rtol=2e-2)


def test_checkpoint_spellings_agree(hf_model):
    """4.x hub names (`vision_tower.vision_model.*`, top-level projector) load the same tensors."""
    old = []
    for name, tensor in _encoder_items(hf_model):
        name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        old.append((name, tensor))
    assert canonical_name("model.vision_tower.vision_model.post_layernorm.weight") == (
        "vision_tower.vision_model.post_layernorm.weight"
    )
    ours = Gemma3ImageEncoder(hf_model.config)
    assert ours.load_weights(old) == {name for name, _ in old}
    pixel_values = _processed(*SIZES)
    with torch.no_grad():
        got = ours(pixel_values)
    torch.testing.assert_close(got, _hf(hf_model, pixel_values), atol=1e-5, rtol=1e-5)


def test_load_weights_rejects_unknown_and_misshapen(hf_model):
    ours = Gemma3ImageEncoder(hf_model.config)
    norm = ours.multi_modal_projector.mm_soft_emb_norm.weight
    before = norm.detach().clone()
    good = ("multi_modal_projector.mm_soft_emb_norm.weight", torch.ones(32))
    bad = ("model.vision_tower.encoder.layers.7.mlp.fc1.weight", torch.zeros(64, 32))
    with pytest.raises(ValueError, match=r"vision_tower\.vision_model\.encoder\.layers\.7"):
        ours.load_weights([good, bad])
    with pytest.raises(ValueError, match="language_model"):
        ours.load_weights([("language_model.model.norm.weight", torch.zeros(64))])
    with pytest.raises(ValueError, match="mm_soft_emb_norm"):
        ours.load_weights([("multi_modal_projector.mm_soft_emb_norm.weight", torch.zeros(31))])
    torch.testing.assert_close(norm, before)  # nothing copied
    head = ("vision_tower.vision_model.head.probe", torch.zeros(1, 1, 32))
    assert ours.load_weights([head]) == set()  # the unused SigLIP pooling head is skipped
    with pytest.raises(ValueError, match="pixel_values"):
        ours(torch.zeros(1, 3, 64, 64))


def test_auto_image_processor_needs_no_torchvision(tmp_path):
    """A Gemma 3 preprocessor_config.json resolves to the PIL backend when torchvision is absent."""
    from transformers import AutoImageProcessor
    from transformers.utils import is_torchvision_available

    config = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_pan_and_scan": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": 56, "width": 56},
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    ip = AutoImageProcessor.from_pretrained(tmp_path)
    if not is_torchvision_available():
        assert type(ip).__name__ == "Gemma3ImageProcessorPil"
        assert "torchvision" not in sys.modules
    image = Image.fromarray(np.zeros((300, 1200, 3), np.uint8))  # 4:1, pan-and-scan splits it
    out = ip(
        [image],
        return_tensors="pt",
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=256,
        pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    assert out["num_crops"].tolist() == [4]
    assert out["pixel_values"].shape == (5, 3, 56, 56)  # the full image, then its crops
