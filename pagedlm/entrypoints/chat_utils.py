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


def _validate(conversation: Any, content_format: str = "string") -> list[dict[str, Any]]:
    """Messages with their content as a string ("string": text parts joined by newlines) or
    as a list of text parts ("openai")."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("A conversation must be a non-empty list of message dicts.")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"Message {i} must be a dict with a 'role', got {message!r:.100}")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or "text" not in part:
                    raise ValueError(
                        f"Message {i}: only {{'type': 'text', 'text': ...}} content parts are "
                        f"supported, got {part!r:.100}"
                    )
                texts.append(part["text"])
            content = "\n".join(texts) if content_format == "string" else content
            message = {**message, "content": content}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"Message {i}: content must be a string or a list of parts.")
        elif content is not None and content_format == "openai":
            message = {**message, "content": [{"type": "text", "text": content}]}
        out.append(message)
    return out


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
) -> list[TokensPrompt]:
    """One conversation (a list of dicts) or a list of them -> token prompts."""
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
        try:
            text = tokenizer.apply_chat_template(
                _validate(conversation, content_format),
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
        prompts.append(TokensPrompt(prompt_token_ids=token_ids, prompt=text))
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
