"""LLM.chat with image content parts on a tiny Qwen2.5-VL: PIL, data-URL and file:// parts
give the tokens `generate` gives on the rendered prompt with the same images; several images
across messages; an unreachable URL is a clear error for that call and the engine serves on."""

from __future__ import annotations

import base64
import io

import pytest

from pagedlm import LLM, SamplingParams
from tests.mm_models import make_tiny_qwen2_5_vl, random_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl-chat"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def llm(qwen_vl, media):
    return LLM(
        str(qwen_vl), dtype="float32", max_model_len=512, allowed_local_media_path=str(media)
    )


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _generate(llm, text, images):
    """generate on the text a chat template renders (tokenized without a BOS, as chat does)."""
    ids = llm.get_tokenizer().encode(f"<|user|>{text}</s><|assistant|>", add_special_tokens=False)
    request = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    return llm.generate(request, GREEDY)[0].outputs[0].token_ids


def test_image_parts_equal_generate(llm, media):
    image = random_image(120, 80, seed=3)
    path = media / "photo.png"
    path.write_bytes(_png(image))
    data_url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    expected = _generate(llm, f"{IMAGE}What is this?", [image])
    for part in (
        {"type": "image_pil", "image_pil": image},
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "image_url", "image_url": {"url": f"file://{path}"}},
    ):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
        assert llm.chat(messages, GREEDY)[0].outputs[0].token_ids == expected, part["type"]


def test_several_images_across_messages(llm):
    a, b = random_image(64, 64, seed=1), random_image(100, 60, seed=2)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "First."}],
        },
        {"role": "assistant", "content": "Seen."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And"}, {"type": "image_pil", "image_pil": b}],
        },
    ]
    out = llm.chat(messages, GREEDY)[0]
    image_id = llm.llm_engine.input_processor.mm_processor.image_token_id
    expected_tokens = sum(
        int(
            llm.llm_engine.input_processor.mm_processor.process_image(im, {})[
                "image_grid_thw"
            ].prod()
        )
        // 4
        for im in (a, b)
    )
    assert out.prompt_token_ids.count(image_id) == expected_tokens


def test_bad_image_parts_fail_the_call_only(llm, media):
    for url, match in (
        ("http://127.0.0.1:9/x.png", "127.0.0.1"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "decode"),
        (f"file://{media.parent}/elsewhere.png", "allowed"),
    ):
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, GREEDY)
    with pytest.raises(NotImplementedError, match="video"):
        llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}])
    assert _generate(llm, f"{IMAGE}ok", [random_image(56, 56)])
