"""The image chat rows of the Ray Data LLM image job, and what it sends and keeps.

Conversations are stored as JSON (images as PNG data URLs). An `image_pil` part holds a data
URL in the JSON and becomes a PIL image in `to_messages`, so PIL objects cross Ray's stages
too. Imported by the job, its Ray workers (pickled pre/postprocess) and the test.
"""

from __future__ import annotations

import base64
import io
import json

from PIL import Image

SAMPLING = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def _data_url(width: int, height: int, seed: int) -> str:
    from tests.mm_models import random_image

    buf = io.BytesIO()
    random_image(width, height, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _url_part(width: int, height: int, seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": _data_url(width, height, seed)}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def conversations() -> list[list[dict]]:
    """One-image, two-image and text-only conversations (JSON-able)."""
    pil = {"type": "image_pil", "image_pil": _data_url(56, 84, 4)}
    return [
        [{"role": "user", "content": [_url_part(56, 56, 1), _text("Describe.")]}],
        [
            {
                "role": "user",
                "content": [_url_part(84, 56, 2), _text("Compare."), _url_part(56, 84, 3)],
            }
        ],
        [{"role": "user", "content": "Question 7: what is 7 plus 7?"}],
        [{"role": "user", "content": [_text("What is this?"), pil]}],
        [
            {"role": "user", "content": [_url_part(112, 56, 5), _text("Describe.")]},
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": [_text("And this one?"), _url_part(56, 56, 6)]},
        ],
    ]


def to_messages(conversation_json: str) -> list[dict]:
    """The stored conversation as chat messages (image_pil parts: PIL images)."""
    messages = json.loads(conversation_json)
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if part["type"] == "image_pil":
                encoded = part["image_pil"].partition(",")[2]
                part["image_pil"] = Image.open(io.BytesIO(base64.b64decode(encoded)))
    return messages


def image_request(row: dict) -> dict:
    return {"messages": to_messages(row["conversation"]), "sampling_params": dict(SAMPLING)}


def image_result(row: dict) -> dict:
    return {
        "id": row["id"],
        "prompt": row["prompt"],
        "prompt_token_ids": [int(t) for t in row["prompt_token_ids"]],
        "answer": row["generated_text"],
        "tokens": [int(t) for t in row["generated_tokens"]],
    }
