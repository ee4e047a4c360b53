"""Render chat conversations to prompts with the tokenizer's (or a given) chat template.

The rendered text is tokenized with add_special_tokens=False, so the template's BOS is not
doubled.
"""

from __future__ import annotations

from typing import Any

import jinja2

from pagedlm.inputs import TokensPrompt


def _validate(conversation: Any) -> list[dict[str, Any]]:
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
            message = {**message, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"Message {i}: content must be a string or a list of parts.")
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
) -> list[TokensPrompt]:
    """One conversation (a list of dicts) or a list of them -> token prompts."""
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
                _validate(conversation),
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
