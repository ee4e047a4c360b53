"""Prompt types (the ``vllm.inputs`` surface) and how one prompt is told apart from a batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

if TYPE_CHECKING:
    import torch


class _PromptOptions(TypedDict, total=False):
    """Optional keys shared by every dict prompt."""

    multi_modal_data: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]
    multi_modal_uuids: dict[str, Any]
    cache_salt: str
    """Mixed into the first block hash, so prefix-cache hits need the same salt."""


class _TextPromptRequired(TypedDict):
    prompt: str


class TextPrompt(_TextPromptRequired, _PromptOptions, total=False):
    """A text prompt; it is tokenized with ``add_special_tokens=True``."""


class _TokensPromptRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, _PromptOptions, total=False):
    """A pre-tokenized prompt; the optional ``prompt`` text is echoed into the output."""

    prompt: str
    token_type_ids: list[int]


class _EmbedsPromptRequired(TypedDict):
    prompt_embeds: torch.Tensor


class EmbedsPrompt(_EmbedsPromptRequired, _PromptOptions, total=False):
    """A prompt given as input embeddings (needs ``enable_prompt_embeds=True``)."""

    prompt: str
    prompt_token_ids: list[int]
    prompt_is_token_ids: bool


class DataPrompt(TypedDict):
    """Raw data for a pooling IO-processor plugin."""

    data: Any
    data_format: str


DecoderOnlyPrompt: TypeAlias = str | list[int] | TextPrompt | TokensPrompt | EmbedsPrompt
SingletonPrompt: TypeAlias = DecoderOnlyPrompt


class ExplicitEncoderDecoderPrompt(TypedDict):
    """Separate encoder and decoder prompts; a None decoder prompt is inferred."""

    encoder_prompt: str | TextPrompt | TokensPrompt
    decoder_prompt: str | TextPrompt | TokensPrompt | None


PromptType: TypeAlias = DecoderOnlyPrompt | ExplicitEncoderDecoderPrompt


def _is_token_ids(value: Any) -> bool:
    """A non-empty list whose items are all ints: one tokenized prompt."""
    return isinstance(value, list) and len(value) > 0 and all(isinstance(t, int) for t in value)


def prompt_to_seq(prompts: PromptType | bytes | Sequence[PromptType | bytes]) -> list[Any]:
    """Return ``prompts`` as a list of single prompts.

    A dict, a str or bytes is ONE prompt, and so is a non-empty list of ints; anything else is
    taken as a sequence of prompts.
    """
    if isinstance(prompts, dict | str | bytes) or _is_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            "prompts must be a string, a list of token ids, a prompt dict ({'prompt': ...} or "
            f"{{'prompt_token_ids': [...]}}), or a list of these; got {type(prompts).__name__} "
            f"{prompts!r:.60}."
        )
    return list(prompts)


def conversation_to_seq(conversations: Sequence[Any]) -> list[Any]:
    """Return ``conversations`` as a list of conversations.

    A non-empty list of dicts (messages) is ONE conversation; anything else is taken as a
    sequence of conversations.
    """
    if (
        isinstance(conversations, list)
        and len(conversations) > 0
        and all(isinstance(m, dict) for m in conversations)
    ):
        return [conversations]
    return list(conversations)


def per_prompt(params: Any, kind: type | tuple[type, ...], n: int, name: str) -> list[Any]:
    """One `kind` object per prompt: `params` itself n times, or a list of n of them."""
    if isinstance(params, kind):
        return [params] * n
    if (
        isinstance(params, Sequence)
        and not isinstance(params, str | bytes)
        and all(isinstance(p, kind) for p in params)
    ):
        if len(params) != n:
            raise ValueError(
                f"The lengths of prompts ({n}) and params ({len(params)}) must be the same."
            )
        return list(params)
    kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
    raise TypeError(
        f"{name} must be a {kinds} or a list of them (one per prompt), got "
        f"{type(params).__name__} {params!r:.60}."
    )
