"""xgrammar backend: compiles constraints into grammars (cached) and makes per-request matchers.

Compilation errors of any kind (bad schema, regex, EBNF/Lark grammar, structural tag) become
``ValueError``s naming the constraint, so the input processor can reject the request up front.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

import numpy as np

from pagedlm.structured_output.request import StructuredOutputKey, StructuredOutputKind

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 1024  # compiled grammars kept (least recently used ones are dropped)


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(
            "Structured outputs need the xgrammar package: pip install 'pagedlm[structured]' "
            "(or pip install xgrammar)."
        ) from e
    return xgrammar


class XgrammarGrammar:
    """One request's matcher. Invariant: it has accepted exactly the request's output tokens
    (until it rejects one, which is logged and leaves the matcher where it was)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_processed_tokens = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self.matcher.is_terminated():
                return True  # tokens after the end (ignore_eos) are not the grammar's
            if not self.matcher.accept_token(token):
                logger.error(
                    "Request %s: token %d rejected by its grammar after %d tokens.",
                    request_id,
                    token,
                    self.num_processed_tokens,
                )
                return False
            self.num_processed_tokens += 1
        return True

    def fill_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend:
    """Owns the tokenizer info, the compiler and the cache of compiled grammars."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2
    ) -> None:
        xgr = import_xgrammar()
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = _tokenizer_info(xgr, tokenizer, vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self._cache: OrderedDict[StructuredOutputKey, Any] = OrderedDict()
        self.num_compilations = 0

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    def compile(self, key: StructuredOutputKey) -> Any:
        """The compiled grammar of ``key``, compiled at most once while it stays cached."""
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        kind, spec = key
        try:
            compiled = self._compile(kind, spec)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / its own error types
            raise ValueError(
                f"Invalid {kind.value} for structured outputs: {_first_line(e)}"
            ) from e
        self.num_compilations += 1
        self._cache[key] = compiled
        if len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: StructuredOutputKind, spec: str) -> Any:
        c = self.compiler
        if kind in (StructuredOutputKind.JSON, StructuredOutputKind.JSON_OBJECT):
            options = json.loads(spec)
            compact = not options["any_whitespace"]  # vLLM: compact separators too
            return c.compile_json_schema(
                json.dumps(options["schema"]),
                any_whitespace=options["any_whitespace"],
                separators=(",", ":") if compact else None,
            )
        if kind is StructuredOutputKind.REGEX:
            return c.compile_regex(spec)
        if kind is StructuredOutputKind.CHOICE:
            return c.compile_grammar(choice_as_grammar(json.loads(spec)))
        if kind is StructuredOutputKind.GRAMMAR:
            if "::=" in spec:
                return c.compile_grammar(spec)  # EBNF (GBNF)
            return c.compile_lark(spec)
        if kind is StructuredOutputKind.STRUCTURAL_TAG:
            return self._compile_structural_tag(spec)
        raise ValueError(f"Unsupported structured output kind {kind}")

    def _compile_structural_tag(self, spec: str) -> Any:
        try:
            tag = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"Invalid structural_tag for structured outputs: {e}") from e
        if isinstance(tag, dict) and "structures" in tag:  # the legacy {structures, triggers}
            items = [
                self.xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                )
                for s in tag["structures"]
            ]
            return self.compiler.compile_structural_tag(items, tag["triggers"])
        return self.compiler.compile_structural_tag(spec)

    def make_grammar(self, key: StructuredOutputKey) -> XgrammarGrammar:
        return XgrammarGrammar(self.xgr.GrammarMatcher(self.compile(key)))


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, padded to the model's ``vocab_size``.

    The tokenizer's special tokens (other than the stop tokens) get an empty string, which
    xgrammar treats as "never text": otherwise a grammar such as ``"<" [a-z]+ ">"`` could be
    satisfied by a special token like ``<s>`` whose surface form happens to match.
    """
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
    )
    stops = set(info.stop_token_ids)
    specials = {i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size} - stops
    if not specials - set(info.special_token_ids):
        return info
    vocab = list(info.decoded_vocab)
    for i in specials:
        vocab[i] = b""
    return xgr.TokenizerInfo(
        vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=sorted(stops)
    )


def choice_as_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes)."""
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {alternatives}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message after the location
    lines = [line for line in text.splitlines() if line.strip()]
    message = lines[0] if lines else type(error).__name__
    if message.startswith("[") and ": " in message:
        message = message.split(": ", 1)[1]
    return message
