"""Token strings for logprobs, outside the incremental detokenizer: each id decoded on its own
(vLLM's ``convert_ids_list_to_tokens``) and the completion of partial UTF-8 ones."""

from __future__ import annotations

import weakref
from typing import Any

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Each id's non-empty string, per tokenizer (keyed weakly on the tokenizer object).
_token_str_cache: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def is_fast_tokenizer(tokenizer: Any) -> bool:
    """True when the tokenizer is backed by a ``tokenizers.Tokenizer``."""
    return bool(getattr(tokenizer, "is_fast", False)) and isinstance(
        getattr(tokenizer, "_tokenizer", None), Tokenizer
    )


def _decode_single_ids_fast(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """``tokenizer.decode([i])`` for each id in one Rust call (fast tokenizers)."""
    texts = tokenizer._tokenizer.decode_batch([[i] for i in token_ids], skip_special_tokens=False)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        clean = tokenizer.clean_up_tokenization
        texts = [clean(t) for t in texts]
    return texts


def convert_ids_list_to_tokens(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Decode each id on its own, as vLLM does for ``Logprob.decoded_token``.

    Equals ``[tokenizer.decode([i]) or "" for i in token_ids]`` (default
    ``skip_special_tokens=False``): special tokens give their text, a byte-level token holding
    an incomplete UTF-8 sequence gives U+FFFD, an out-of-vocabulary id gives "".
    Non-empty results are cached per tokenizer (an id's text never changes, even when tokens
    are added later; empty ones are not cached since the id may become valid).
    """
    if not token_ids:
        return []
    try:
        cache = _token_str_cache.get(tokenizer)
        if cache is None:
            cache = _token_str_cache[tokenizer] = {}
    except TypeError:
        cache = {}
    get = cache.get
    out = [get(i) for i in token_ids]
    if None not in out:
        return out  # type: ignore[return-value]
    missing = list(dict.fromkeys(i for i, text in zip(token_ids, out, strict=True) if text is None))
    texts: dict[int, str] = {}
    from transformers import PreTrainedTokenizerFast

    if is_fast_tokenizer(tokenizer) and type(tokenizer)._decode is PreTrainedTokenizerFast._decode:
        valid = [i for i in missing if 0 <= i < 2**32]
        texts.update(zip(valid, _decode_single_ids_fast(tokenizer, valid), strict=True))
    else:
        for i in missing:
            try:
                texts[i] = tokenizer.decode([i]) or ""
            except (OverflowError, TypeError, IndexError, ValueError):
                pass
    cache.update((i, text) for i, text in texts.items() if text)
    return [
        texts.get(i, "") if text is None else text for i, text in zip(token_ids, out, strict=True)
    ]


def correct_decoded_tokens(
    tokenizer: Any, decoded_tokens: list[str], token_ids: list[int], context_token_ids: list[int]
) -> list[str]:
    """vLLM's ``LogprobsProcessor._verify_tokens``: fix, in place, the strings of one
    position's candidates (``token_ids``) that end in U+FFFD.

    ``context_token_ids`` are the sampled (or actual prompt) tokens of the preceding positions,
    oldest first. Each such candidate is decoded after the last 1..4 of them, taking the first
    decode that does not end in U+FFFD; its text is what follows the decode of the context's
    leading tokens that are not themselves partial characters. Where none completes, "".
    """
    for idx, text in enumerate(decoded_tokens):
        if text.endswith(REPLACEMENT_CHAR):
            decoded_tokens[idx] = _complete_token(tokenizer, token_ids[idx], context_token_ids)
    return decoded_tokens


def _complete_token(tokenizer: Any, token_id: int, context_token_ids: list[int]) -> str:
    for num_context in range(1, min(len(context_token_ids), 4) + 1):
        context = context_token_ids[-num_context:]
        full = tokenizer.decode([*context, token_id])
        if full.endswith(REPLACEMENT_CHAR):
            continue
        # Context tokens that were partial characters gave "" themselves: their bytes belong
        # to this token's text.
        clean_end = len(context)
        while clean_end > 0 and tokenizer.decode([context[clean_end - 1]]).endswith(
            REPLACEMENT_CHAR
        ):
            clean_end -= 1
        prefix = tokenizer.decode(context[:clean_end]) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0  # normalization may change the prefix: keep what follows the common part
        for a, b in zip(prefix, full, strict=True):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""
