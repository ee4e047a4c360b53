"""vllm.entrypoints.chat_utils -> pagedlm.entrypoints.chat_utils.

parse_chat_messages(_async) is vLLM's split of chat rendering that Ray Data LLM's
PrepareMultimodalStage calls: the messages with image parts replaced (the model's placeholder
text, or {"type": "image"} parts), and the images, decoded by pagedlm's chat parser."""

import asyncio
from typing import Any

from pagedlm.entrypoints.chat_utils import (
    parse_conversation,
    resolve_hf_chat_template,  # noqa: F401
)
from pagedlm.models.registry import ModelRegistry

_IMAGE_PARTS = ("image_url", "image_pil", "image")


def _image_uuids(messages: list[dict[str, Any]]) -> list[str | None]:
    """The `uuid` of each image part, in the order the images are taken."""
    return [
        part.get("uuid")
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS
    ]


def parse_chat_messages(
    messages: list[dict[str, Any]], model_config: Any, content_format: str = "string"
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None]:
    """(conversation, multi_modal_data or None, multi_modal_uuids or None) of one chat."""
    if content_format not in ("string", "openai"):
        raise ValueError(f"content_format must be 'string' or 'openai', got {content_format!r}.")
    conversation, images = parse_conversation(
        messages,
        content_format,
        ModelRegistry.image_placeholder(model_config.architecture),
        model_config.allowed_local_media_path,
    )
    if not images:
        return conversation, None, None
    uuids = _image_uuids(messages)
    return conversation, {"image": images}, {"image": uuids} if any(uuids) else None


async def parse_chat_messages_async(
    messages: list[dict[str, Any]], model_config: Any, content_format: str = "string"
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None]:
    """parse_chat_messages in a worker thread (http images download without blocking the loop)."""
    return await asyncio.to_thread(parse_chat_messages, messages, model_config, content_format)
