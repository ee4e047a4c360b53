"""Incremental detokenization and stop-string matching (per-token strings for logprobs are in
``detokenizer_utils``).

Behaviour follows vLLM v1 (``vllm/v1/engine/detokenizer.py``), reimplemented here.

Invariants of :class:`IncrementalDetokenizer`:

* ``token_ids`` holds every generated token in order, including a final EOS/stop token and any
  tokens that come after a stop-string match; the prompt is never in it.
* ``output_text`` only ever grows by whole characters: a multi-byte UTF-8 character split over
  several byte-level tokens is emitted once it is complete, never as U+FFFD in between.
* Text is decoded in the context of the previous tokens (starting from a few prompt tokens), so
  spacing matches decoding the whole sequence: ``output_text`` equals
  ``decode(prompt + gen)[len(decode(prompt)):]`` (no ``clean_up_tokenization_spaces``), which
  for byte-level BPE is just ``decode(gen)``.  SentencePiece tokenizers thus keep the leading
  space of the first generated word, as in vLLM.
* When a request ends on EOS or a stop token id (``stop_terminated``) and
  ``include_stop_str_in_output`` is False, that last token is in ``token_ids`` but not in the text.
* Stop strings are only searched in text produced after the first ``min_tokens`` tokens (plus
  ``len(stop) - 1`` characters before it, so a stop string spanning tokens is found).  On a
  match ``output_text`` is cut before the stop string (after it when
  ``include_stop_str_in_output``) and later updates no longer add text.
* Work per update is O(new tokens) (plus a small window of context tokens); nothing loops over
  the whole sequence.

Fast (Rust-backed) tokenizers use ``tokenizers.decoders.DecodeStream``; slow Python tokenizers
use the prefix/read-offset technique over token strings.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagedlm.engine.detokenizer_utils import REPLACEMENT_CHAR, is_fast_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["IncrementalDetokenizer", "check_stop_strings"]

_INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"
# Prompt tokens used as decoding context: the shortest clean suffix of at least _MIN_CONTEXT
# tokens, looking back at most _MAX_CONTEXT tokens.
_MIN_CONTEXT = 4
_MAX_CONTEXT = 24
# Slow path: prefix window size (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_SLOW_OFFSET = 5


# Per-tokenizer cache, keyed weakly on the tokenizer object.
_added_tokens_cache: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def _added_token_contents(tokenizer: Any) -> dict[int, str]:
    """``{id: content}`` of a fast tokenizer's added tokens (cached)."""
    try:
        cached = _added_tokens_cache.get(tokenizer)
    except TypeError:
        cached = None
    if cached is None:
        cached = {
            tid: tok.content for tid, tok in tokenizer._tokenizer.get_added_tokens_decoder().items()
        }
        try:
            _added_tokens_cache[tokenizer] = cached
        except TypeError:
            pass
    return cached


class _NullStream:
    """No tokenizer: produce no text."""

    def step(self, token_id: int) -> str:
        return ""


class _FastStream:
    """Incremental decoding with the Rust ``DecodeStream`` of a fast tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self.tokenizer: Tokenizer = tokenizer._tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = self._prompt_context(prompt_token_ids)
        self.recent: list[int] = list(context)
        self.stream = self._new_stream(context)

        # Fast tokenizers never put spaces between special tokens; vLLM still returns the raw
        # content for consecutive added tokens when asked not to.
        self.raw_added: dict[int, str] | None = None
        self.last_added = False
        if not (skip_special_tokens or spaces_between_special_tokens):
            added = _added_token_contents(tokenizer)
            if added:
                self.raw_added = added

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """Shortest prompt suffix (>= 4 tokens) that decodes without U+FFFD."""
        n = len(prompt_token_ids)
        if n <= _MIN_CONTEXT:
            return list(prompt_token_ids)
        decode = self.tokenizer.decode
        for i in range(_MIN_CONTEXT, min(n, _MAX_CONTEXT) + 1):
            suffix = prompt_token_ids[-i:]
            if REPLACEMENT_CHAR not in decode(suffix):
                return list(suffix)
        return list(prompt_token_ids[-_MAX_CONTEXT:])

    def _new_stream(self, context: list[int]) -> DecodeStream:
        """A fresh stream primed with ``context`` (its output discarded)."""
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for tid in context:
            try:
                stream.step(self.tokenizer, tid)
            except Exception:  # a broken context only costs spacing; start clean
                stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return stream

    def step(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.tokenizer, token_id)
        except (OverflowError, TypeError):
            logger.warning("Encountered invalid token id: %r", token_id)
            text = None
        except Exception as e:  # tokenizers raises a plain Exception
            if not str(e).startswith(_INVALID_PREFIX_ERR_MSG):
                raise
            # Non-monotonic decoding broke the stream's state: restart from recent context.
            logger.warning("Invalid prefix during incremental detokenization; resetting stream")
            self.stream = self._new_stream(self.recent[-_MIN_CONTEXT:])
            text = self.stream.step(self.tokenizer, token_id)
        recent = self.recent
        recent.append(token_id)
        if len(recent) > 2 * _MAX_CONTEXT:
            del recent[:-_MAX_CONTEXT]

        if self.raw_added is not None:
            content = self.raw_added.get(token_id)
            if content is not None and self.last_added:
                text = content
            self.last_added = content is not None
        return text or ""


class _SlowStream:
    """Prefix/read-offset incremental decoding over token strings (Python tokenizers)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.vocab_len = len(tokenizer)
        self.added_vocab = set(tokenizer.get_added_vocab())
        self.special_tokens = set(tokenizer.all_special_tokens) if skip_special_tokens else set()
        tokens = tokenizer.convert_ids_to_tokens(
            list(prompt_token_ids[-_SLOW_OFFSET - 2 :]), skip_special_tokens=skip_special_tokens
        )
        self.tokens: list[str] = [t or "" for t in tokens]
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _SLOW_OFFSET, 0)

    def _to_string(self, tokens: list[str]) -> str:
        if not self.added_vocab:
            return self.tokenizer.convert_tokens_to_string(tokens)
        # Added tokens are not passed through convert_tokens_to_string (as HF slow decode does).
        sub_texts: list[str] = []
        current: list[str] = []
        for token in tokens:
            if token in self.special_tokens:
                continue
            if token in self.added_vocab:
                if current:
                    sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
                    current = []
                sub_texts.append(token)
            else:
                current.append(token)
        if current:
            sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
        return (" " if self.spaces_between_special_tokens else "").join(sub_texts)

    def step(self, token_id: int) -> str:
        if 0 <= token_id < self.vocab_len:
            new = self.tokenizer.convert_ids_to_tokens(
                [token_id], skip_special_tokens=self.skip_special_tokens
            )
            if isinstance(new, str):
                new = [new]
            self.tokens.extend(t or "" for t in new)
        else:
            self.tokens.append("")
        tokens = self.tokens
        prefix_text = self._to_string(tokens[self.prefix_offset : self.read_offset])
        new_text = self._to_string(tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Incomplete UTF-8 at the end (or nothing new): wait for more tokens.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(tokens)
        # Drop token strings that can no longer be part of the window.
        if self.prefix_offset > 4 * _MAX_CONTEXT:
            cut = self.prefix_offset
            del tokens[:cut]
            self.prefix_offset -= cut
            self.read_offset -= cut
        return new_text[len(prefix_text) :]


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string in the last ``new_char_count`` chars (vLLM semantics).

    Returns ``(stop_string, truncate_to)`` or None; ``truncate_to == -1`` means no truncation.
    Stop strings are tried in list order.
    """
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        stop_len = len(stop_str)
        # Start len(stop_str) - 1 chars before the new text so boundary-spanning matches count.
        start = max(0, len(output_text) + 1 - new_char_count - stop_len)
        stop_index = output_text.find(stop_str, start)
        if stop_index == -1:
            continue
        if include_in_output:
            stop_index += stop_len
            if stop_index >= len(output_text):
                return stop_str, -1
        return stop_str, stop_index
    return None


class IncrementalDetokenizer:
    """Per-request incremental detokenizer with stop-string handling (vLLM v1 semantics)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.output_text: str = ""
        self.stop: list[str] = list(stop) if stop else []
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Characters held back from non-final streamed text (a stop string may be forming).
        if self.stop and not include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0
        self._last_output_text_offset = 0
        self._stopped = False

        self._stream: _NullStream | _FastStream | _SlowStream
        if tokenizer is None:
            self._stream = _NullStream()
        elif is_fast_tokenizer(tokenizer):
            self._stream = _FastStream(
                tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens
            )
        else:
            self._stream = _SlowStream(
                tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens
            )

    @property
    def output_token_ids(self) -> list[int]:
        """Alias of ``token_ids`` (generated tokens only)."""
        return self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append tokens, extend ``output_text`` and check stop strings.

        ``stop_terminated`` means the last new token is the EOS/stop token that ended the
        request; it is then not rendered unless ``include_stop_str_in_output``.
        Returns the matched stop string, else None.
        """
        if not new_token_ids:
            return None
        if self._stopped:
            # Text already ended at a stop string; keep the tokens only.
            self.token_ids.extend(new_token_ids)
            return None

        skipped: int | None = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]

        step = self._stream.step
        token_ids = self.token_ids
        min_tokens = self.min_tokens
        pieces: list[str] = []
        # Text made while len(token_ids) <= min_tokens is not searched for stop strings.
        unchecked_chars = 0
        for tid in new_token_ids:
            token_ids.append(tid)
            piece = step(tid)
            if piece:
                pieces.append(piece)
            if min_tokens and len(token_ids) <= min_tokens:
                unchecked_chars += len(piece)
        new_text = "".join(pieces)
        if new_text:
            self.output_text += new_text
        if skipped is not None:
            token_ids.append(skipped)

        if not self.stop or len(token_ids) <= min_tokens:
            return None
        match = check_stop_strings(
            self.output_text,
            len(new_text) - unchecked_chars,
            self.stop,
            self.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_str, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        self._stopped = True
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report; holds back a possible partial stop string unless ``finished``.

        With ``delta`` only the part not returned by an earlier delta call is returned.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        text = self.output_text
        length = max(len(text) - buffer_length, 0)
        if not delta:
            return text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return text[last:length]
        return ""
