"""Render chat conversations to prompts with the tokenizer's (or a given) chat template.

The rendered text is tokenized with add_special_tokens=False, so the template's BOS is not
doubled.
"""

from __future__ import annotations

from typing import Any

import jinja2

from pagedlm.inputs import TokensPrompt

CONTENT_FORMATS = ("auto", "string", "openai")


def detect_content_format(template: str | None) -> str:
    """vLLM's "auto": "openai" when the template loops over a message's content (it expects a
    list of parts), else "string"."""
    if not isinstance(template, str) or not template:
        return "string"
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"  # rendering reports it
    for loop in ast.find_all(jinja2.nodes.For):
        nodes = [loop.iter, *loop.iter.find_all(jinja2.nodes.Node)]
        words = {getattr(n, key, None) for n in nodes for key in ("name", "value", "attr")}
        if "content" in words:
            return "openai"
    return "string"


_REFUSED_PARTS = ("video_url", "video", "input_audio", "audio_url", "audio", "image_embeds")


def _image_of(part: dict[str, Any], allowed_local_media_path: str) -> Any:
    """The PIL image of an image content part (fetched or decoded now)."""
    from pagedlm.multimodal.image import fetch_image, to_pil_images

    kind = part["type"]
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        return fetch_image(url, allowed_local_media_path=allowed_local_media_path)
    images = to_pil_images(part.get(kind))  # image_pil / image: a PIL image or an array
    if len(images) != 1:
        raise ValueError(f"An {kind!r} content part holds one image, got {len(images)}.")
    return images[0]


def _string_content(texts: list[str], num_images: int, image_placeholder: str, i: int) -> str:
    """vLLM's rule: the texts joined by newlines, after a placeholder per image that the text
    does not already hold."""
    text = "\n".join(texts)
    missing = num_images - text.count(image_placeholder)
    if missing < 0:
        raise ValueError(
            f"Message {i}: found more {image_placeholder!r} placeholders in the text than "
            f"images ({num_images})."
        )
    return "\n".join([image_placeholder] * missing + ([text] if text else []))


def parse_conversation(
    conversation: Any,
    content_format: str = "string",
    image_placeholder: str | None = None,
    allowed_local_media_path: str = "",
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with their content as a string ("string": text parts joined by newlines, the
    model's image placeholder before them per image) or as a list of parts ("openai": image
    parts become {"type": "image"}), the images in order)."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("A conversation must be a non-empty list of message dicts.")
    out, images = [], []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"Message {i} must be a dict with a 'role', got {message!r:.100}")
        content = message.get("content")
        if isinstance(content, list):
            texts, parts, num_images = [], [], 0
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and "text" in part:
                    texts.append(part["text"])
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image_url", "image_pil", "image"):
                    images.append(_image_of(part, allowed_local_media_path))
                    parts.append({"type": "image"})
                    num_images += 1
                elif kind in _REFUSED_PARTS:
                    raise NotImplementedError(
                        f"Message {i}: {kind!r} content parts are not supported by pagedlm "
                        "(text and image parts are)."
                    )
                else:
                    raise ValueError(
                        f"Message {i}: content parts must be text ({{'type': 'text', 'text': "
                        f"...}}) or images (image_url, image_pil), got {part!r:.100}"
                    )
            if content_format == "string":
                if num_images and image_placeholder is None:
                    raise ValueError(
                        f"Message {i} has an image but this model has no image placeholder "
                        "(it does not take images)."
                    )
                content = (
                    _string_content(texts, num_images, image_placeholder, i)
                    if num_images
                    else "\n".join(texts)
                )
            else:
                content = parts
            message = {**message, "content": content}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"Message {i}: content must be a string or a list of parts.")
        elif content is not None and content_format == "openai":
            message = {**message, "content": [{"type": "text", "text": content}]}
        out.append(message)
    return out, images


def render_conversations(
    tokenizer: Any,
    messages: Any,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template_content_format: str = "auto",
    image_placeholder: str | None = None,
    allowed_local_media_path: str = "",
) -> list[TokensPrompt]:
    """One conversation (a list of dicts) or a list of them -> token prompts; a conversation
    with images gets `multi_modal_data={"image": [...]}` (`image_placeholder`: the model's
    text per image for string-format templates; file:// images only under
    `allowed_local_media_path`)."""
    if chat_template_content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {CONTENT_FORMATS}, got "
            f"{chat_template_content_format!r}."
        )
    content_format = chat_template_content_format
    if content_format == "auto":
        content_format = detect_content_format(
            chat_template or getattr(tokenizer, "chat_template", None)
        )
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, "
            "and add_generation_prompt when you want to add a header that will prompt it to "
            "start a new assistant message instead."
        )
    single = isinstance(messages, list) and messages and isinstance(messages[0], dict)
    conversations = [messages] if single else list(messages)
    prompts: list[TokensPrompt] = []
    for conversation in conversations:
        messages, images = parse_conversation(
            conversation, content_format, image_placeholder, allowed_local_media_path
        )
        try:
            text = tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except jinja2.TemplateError as e:
            source = "chat_template passed in" if chat_template else "model's chat template"
            raise ValueError(
                f"The {source} cannot be rendered ({type(e).__name__}: {e}); fix the template "
                "or pass a working one as chat_template=."
            ) from e
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        prompt = TokensPrompt(prompt_token_ids=token_ids, prompt=text)
        if images:
            prompt["multi_modal_data"] = {"image": images}
        prompts.append(prompt)
    return prompts


def resolve_hf_chat_template(
    tokenizer: Any,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None,
    *,
    model_config: Any = None,
    trust_remote_code: bool = False,
) -> str | None:
    """The template to render with: the given one, else the tokenizer's (None if it has none)."""
    if chat_template is not None:
        return chat_template
    get = getattr(tokenizer, "get_chat_template", None)
    if get is None:
        return None
    try:
        return get(chat_template, tools=tools)
    except ValueError:  # transformers: the tokenizer has no chat template
        return None
