"""render_conversations with image content parts, on the tiny test tokenizer: an "openai"-format
template sees {"type": "image"} parts, a "string"-format one the model's placeholder text; the
images go into multi_modal_data in order; video/audio/embeds parts are refused by name."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from pagedlm.entrypoints.chat_utils import detect_content_format, render_conversations
from tests.tiny_tokenizer import build_tiny_tokenizer

# loops over each message's content parts, as HF templates of vision models do
OPENAI_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:"
    "{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<img>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}|{% endfor %}"
)
PH = "<start_of_image>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _image(seed: int, size: tuple[int, int] = (10, 6)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _same(a: Image.Image, b: Image.Image) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b))


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def pil(image: Image.Image) -> dict:
    return {"type": "image_pil", "image_pil": image}


def url(u: str) -> dict:
    return {"type": "image_url", "image_url": {"url": u}}


def test_openai_template_sees_image_parts(tokenizer) -> None:
    assert detect_content_format(OPENAI_TEMPLATE) == "openai"
    a, b, c = _image(1), _image(2), _image(3)
    conversation = [
        {"role": "user", "content": [text("A"), pil(a), text("B"), url(_data_url(b))]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": _data_url(c)}]},
    ]
    (p,) = render_conversations(tokenizer, conversation, chat_template=OPENAI_TEMPLATE)
    assert p["prompt"] == "user:A<img>B<img>|assistant:ok|user:<img>|"
    assert p["prompt_token_ids"] == tokenizer.encode(p["prompt"], add_special_tokens=False)
    images = p["multi_modal_data"]["image"]
    assert len(images) == 3 and images[0] is a
    assert _same(images[1], b) and _same(images[2], c) and images[1].mode == "RGB"


def test_string_template_gets_the_placeholder(tokenizer) -> None:
    a, b = _image(1), _image(2)
    conversation = [
        {"role": "user", "content": [text("What is this?"), pil(a)]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [pil(a), pil(b), text("And these?")]},
    ]
    (p,) = render_conversations(tokenizer, conversation, image_placeholder=PH)
    assert p["prompt"] == (
        f"<|user|>{PH}\nWhat is this?</s><|assistant|>A cat.</s>"
        f"<|user|>{PH}\n{PH}\nAnd these?</s><|assistant|>"
    )
    assert p["multi_modal_data"]["image"] == [a, a, b]
    (only,) = render_conversations(
        tokenizer, [{"role": "user", "content": [pil(a)]}], image_placeholder=PH
    )
    assert only["prompt"] == f"<|user|>{PH}</s><|assistant|>"


def test_string_template_keeps_placeholders_the_text_holds(tokenizer) -> None:
    a, b = _image(1), _image(2)
    content = [text(f"Left {PH} and right:"), pil(a), pil(b)]
    (p,) = render_conversations(
        tokenizer, [{"role": "user", "content": content}], image_placeholder=PH
    )
    assert p["prompt"] == f"<|user|>{PH}\nLeft {PH} and right:</s><|assistant|>"  # vLLM's rule
    with pytest.raises(ValueError, match="more .* placeholders in the text than images"):
        render_conversations(
            tokenizer,
            [{"role": "user", "content": [text(f"{PH}{PH}"), pil(a)]}],
            image_placeholder=PH,
        )


def test_string_template_needs_the_models_placeholder(tokenizer) -> None:
    with pytest.raises(ValueError, match="no image placeholder"):
        render_conversations(tokenizer, [{"role": "user", "content": [pil(_image(1))]}])


def test_text_only_is_unchanged(tokenizer) -> None:
    for template in (None, OPENAI_TEMPLATE):
        conv = [{"role": "user", "content": [text("a"), text("b")]}]
        (p,) = render_conversations(tokenizer, conv, chat_template=template, image_placeholder=PH)
        assert set(p) == {"prompt_token_ids", "prompt"}
        assert p["prompt_token_ids"] == tokenizer.encode(p["prompt"], add_special_tokens=False)
    (s,) = render_conversations(tokenizer, [{"role": "user", "content": "Hello"}])
    assert s == {
        "prompt": "<|user|>Hello</s><|assistant|>",
        "prompt_token_ids": tokenizer.encode(
            "<|user|>Hello</s><|assistant|>", add_special_tokens=False
        ),
    }


def test_a_batch_keeps_each_conversations_images(tokenizer) -> None:
    a, b = _image(1), _image(2)
    batch = [
        [{"role": "user", "content": [pil(a), text("x")]}],
        [{"role": "user", "content": "no image"}],
        [{"role": "user", "content": [pil(b)]}],
    ]
    first, second, third = render_conversations(tokenizer, batch, image_placeholder=PH)
    assert first["multi_modal_data"] == {"image": [a]}
    assert "multi_modal_data" not in second
    assert third["multi_modal_data"] == {"image": [b]}


def test_file_urls_follow_allowed_local_media_path(tokenizer, tmp_path) -> None:
    image = _image(4)
    image.save(tmp_path / "a.png")
    conv = [{"role": "user", "content": [url(f"file://{tmp_path}/a.png")]}]
    (p,) = render_conversations(
        tokenizer, conv, image_placeholder=PH, allowed_local_media_path=str(tmp_path)
    )
    assert _same(p["multi_modal_data"]["image"][0], image)
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        render_conversations(tokenizer, conv, image_placeholder=PH)


@pytest.mark.parametrize(
    "part, match",
    [
        (url("data:image/png;base64," + base64.b64encode(b"nope").decode()), "cannot decode"),
        (url("http://127.0.0.1:9/x.png"), r"127\.0\.0\.1:9/x\.png"),
        (url("x.png"), "HTTP, data or file URL"),
        ({"type": "image_pil", "image_pil": "not an image"}, "unsupported image type str"),
        ({"type": "image_pil", "image_pil": None}, "holds one image, got 0"),
        ({"type": "hologram", "hologram": 1}, "content parts must be text"),
    ],
)
def test_bad_image_parts_raise_value_error(tokenizer, part, match) -> None:
    conv = [{"role": "user", "content": [text("hi"), part]}]
    with pytest.raises(ValueError, match=match):
        render_conversations(tokenizer, conv, image_placeholder=PH)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "video_url", "video_url": {"url": "https://x/a.mp4"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}},
        {"type": "image_embeds", "image_embeds": "AAAA"},
    ],
)
def test_video_audio_and_embeds_parts_are_refused_by_name(tokenizer, part) -> None:
    conv = [{"role": "user", "content": [text("hi"), part]}]
    with pytest.raises(NotImplementedError, match=part["type"]):
        render_conversations(tokenizer, conv, image_placeholder=PH)
