"""Structured outputs (vLLM v1's design): the engine-side manager owns grammars and matchers.

Per request: the input processor validates (compiles, cached) the constraint; the engine gives
each core request its own matcher. Per step: after scheduling, the manager fills one bitmask
row for every scheduled request that samples this step and has a grammar; the rows travel to
the worker as plain data (``GrammarOutput``); the sampler masks those rows' logits. After
sampling, the scheduler advances each matcher with the accepted token.

xgrammar is imported only when the first structured request arrives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedlm.config import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsConfig
from pagedlm.structured_output.request import (
    StructuredOutputRequest,
    get_structured_output_key,
)

if TYPE_CHECKING:
    from pagedlm.core.request import Request
    from pagedlm.sampling_options import StructuredOutputsParams
    from pagedlm.structured_output.backend_xgrammar import XgrammarBackend


@dataclass
class GrammarOutput:
    """This step's grammar bitmask: row i constrains the request ``req_ids[i]``.

    ``bitmask`` is int32 ``[len(req_ids), ceil(vocab_size / 32)]``; bit j of word w allows
    token ``32 * w + j``.
    """

    req_ids: list[str]
    bitmask: np.ndarray


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.config = config or StructuredOutputsConfig()
        self._backend: XgrammarBackend | None = None

    @property
    def backend(self) -> XgrammarBackend:
        if self._backend is None:
            from pagedlm.structured_output.backend_xgrammar import XgrammarBackend

            self._backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._backend

    def _key(self, params: StructuredOutputsParams):
        if self.config.disable_any_whitespace or self.config.disable_additional_properties:
            params.disable_any_whitespace |= self.config.disable_any_whitespace
            params.disable_additional_properties |= self.config.disable_additional_properties
        backend = params._backend
        if backend not in (None, *STRUCTURED_OUTPUT_BACKENDS):
            raise ValueError(
                f"Request-level structured output backend {backend!r} is not available; "
                "pagedlm supports xgrammar."
            )
        return get_structured_output_key(params)

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile (or find cached) the grammar of ``params``; ValueError if it is invalid."""
        if self.tokenizer is None:
            raise ValueError(
                "Structured outputs requires a tokenizer; it is not available with "
                "skip_tokenizer_init=True."
            )
        self.backend.compile(self._key(params))

    def init_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A fresh matcher for one core request (each n>1 child gets its own)."""
        key = self._key(params)
        return StructuredOutputRequest(key, self.backend.make_grammar(key))

    def grammar_bitmask(self, scheduled: Iterable[Request]) -> GrammarOutput | None:
        """Bitmask rows for the scheduled requests that sample this step and have a grammar.

        Call after ``schedule()``: a request samples when its computed tokens (this step's
        included) reach its length.
        """
        rows = [
            r
            for r in scheduled
            if r.structured_output_request is not None and r.num_computed_tokens == r.num_tokens
        ]
        if not rows:
            return None
        bitmask = np.empty((len(rows), self.backend.bitmask_width), dtype=np.int32)
        for i, request in enumerate(rows):
            request.structured_output_request.grammar.fill_bitmask(bitmask, i)
        return GrammarOutput([r.request_id for r in rows], bitmask)


def advance_grammar(request: Request, new_token_ids: list[int]) -> bool:
    """Feed the sampled tokens to the request's matcher; True when its grammar has ended."""
    so_request = request.structured_output_request
    if so_request is None:
        return False
    so_request.grammar.accept_tokens(request.request_id, new_token_ids)
    return so_request.grammar.is_terminated()


__all__ = [
    "GrammarOutput",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "StructuredOutputsConfig",
    "advance_grammar",
]
