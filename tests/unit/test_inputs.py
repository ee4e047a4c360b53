"""prompt_to_seq tells one prompt apart from a batch of prompts."""

from __future__ import annotations

from typing import Any

import pytest

from pagedlm.inputs import TextPrompt, TokensPrompt, conversation_to_seq, prompt_to_seq


@pytest.mark.parametrize(
    "prompt",
    [
        "hello",
        b"raw",
        [1, 2, 3],
        [0],
        {"prompt": "hi"},
        {"prompt_token_ids": [1, 2]},
        {"encoder_prompt": "a", "decoder_prompt": None},
    ],
)
def test_single_prompt(prompt: Any) -> None:
    out = prompt_to_seq(prompt)
    assert out == [prompt] and out[0] is prompt


@pytest.mark.parametrize(
    ("prompts", "expected_len"),
    [
        (["a", "b"], 2),
        ([[1, 2], [3]], 2),
        ([{"prompt": "x"}, "y", [4]], 3),
        ([], 0),
        (("a", "b"), 2),
        ([TokensPrompt(prompt_token_ids=[1])], 1),
    ],
)
def test_batch(prompts: Any, expected_len: int) -> None:
    out = prompt_to_seq(prompts)
    assert isinstance(out, list) and len(out) == expected_len
    assert all(a is b for a, b in zip(out, prompts, strict=True))


def test_typed_dicts() -> None:
    text: TextPrompt = {"prompt": "hi", "cache_salt": "s"}
    tokens: TokensPrompt = {"prompt_token_ids": [1], "prompt": "x", "token_type_ids": [0]}
    assert TextPrompt.__required_keys__ == frozenset({"prompt"})
    assert TokensPrompt.__required_keys__ == frozenset({"prompt_token_ids"})
    assert {
        "prompt",
        "token_type_ids",
        "cache_salt",
        "multi_modal_data",
        "mm_processor_kwargs",
    } <= (TokensPrompt.__optional_keys__)
    assert text["prompt"] == "hi" and tokens["prompt_token_ids"] == [1]


def test_conversation_to_seq() -> None:
    conv = [{"role": "user", "content": "hi"}]
    assert conversation_to_seq(conv) == [conv]
    assert conversation_to_seq([conv, conv]) == [conv, conv]
    assert conversation_to_seq([]) == []
