"""Chat rendering: templates, options, content parts, and errors for malformed messages."""

from __future__ import annotations

import pytest

from pagedlm.entrypoints.chat_utils import render_conversations
from tests.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_one_conversation_and_a_batch(tokenizer) -> None:
    conv = [{"role": "user", "content": "Hello"}]
    (one,) = render_conversations(tokenizer, conv)
    assert one["prompt"] == "<|user|>Hello</s><|assistant|>"
    # rendered text is tokenized without adding special tokens again (no double BOS)
    assert one["prompt_token_ids"] == tokenizer.encode(one["prompt"], add_special_tokens=False)
    batch = render_conversations(tokenizer, [conv, conv])
    assert len(batch) == 2 and batch[0] == one


def test_text_parts_options_and_custom_template(tokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    (p,) = render_conversations(tokenizer, parts, add_generation_prompt=False)
    assert p["prompt"] == "<|user|>a\nb</s>"
    template = "{% for m in messages %}[{{ m['content'] }}|{{ flavor }}]{% endfor %}"
    (q,) = render_conversations(
        tokenizer,
        [{"role": "user", "content": "x"}],
        chat_template=template,
        chat_template_kwargs={"flavor": "mint"},
    )
    assert q["prompt"] == "[x|mint]"


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ([{"content": "no role"}], "must be a dict with a 'role'"),
        (["just a string"], "must be a dict with a 'role'"),
        ([{"role": "user", "content": 5}], "content must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            "HTTP, data or file URL",
        ),
    ],
)
def test_malformed_messages(tokenizer, messages, match) -> None:
    with pytest.raises(ValueError, match=match):
        render_conversations(tokenizer, [messages] if messages else [messages])


def test_generation_prompt_and_continue_are_exclusive(tokenizer) -> None:
    conv = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="not compatible"):
        render_conversations(
            tokenizer, conv, add_generation_prompt=True, continue_final_message=True
        )
