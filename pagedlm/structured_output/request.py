"""What a request asks of structured outputs: its grammar key, and its live grammar matcher.

The key is ``(kind, spec)``: the kind of constraint and a canonical string of it, so equal
constraints share one compiled grammar.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Protocol

from pagedlm.sampling_options import StructuredOutputsParams


class StructuredOutputKind(Enum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    STRUCTURAL_TAG = "structural_tag"


StructuredOutputKey = tuple[StructuredOutputKind, str]


def get_structured_output_key(params: StructuredOutputsParams) -> StructuredOutputKey:
    """``(kind, spec)`` of the one constraint set in ``params``; ValueError for empty ones.

    ``spec`` is a string: a JSON schema given as a dict is dumped (keys sorted), choices are
    dumped as a JSON list, and options that change the grammar are folded into JSON specs.
    """
    if params.whitespace_pattern is not None:
        raise ValueError(
            "structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
            "use disable_any_whitespace=True for compact JSON."
        )
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"Invalid JSON schema for structured outputs: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                "structured_outputs.json must be a JSON schema (an object), got "
                f"{type(schema).__name__}."
            )
        return StructuredOutputKind.JSON, _json_spec(schema, params)
    if params.json_object:
        return StructuredOutputKind.JSON_OBJECT, _json_spec({"type": "object"}, params)
    if params.regex is not None:
        if not params.regex:
            raise ValueError("structured_outputs.regex cannot be empty.")
        return StructuredOutputKind.REGEX, params.regex
    if params.choice is not None:
        if not params.choice:
            raise ValueError("structured_outputs.choice cannot be an empty list.")
        if not all(isinstance(c, str) for c in params.choice):
            raise ValueError("structured_outputs.choice must be a list of strings.")
        return StructuredOutputKind.CHOICE, json.dumps(list(params.choice))
    if params.grammar is not None:
        if not params.grammar.strip():
            raise ValueError("structured_outputs.grammar cannot be empty.")
        return StructuredOutputKind.GRAMMAR, params.grammar
    if params.structural_tag is not None:
        return StructuredOutputKind.STRUCTURAL_TAG, params.structural_tag
    raise ValueError(
        "structured_outputs has no constraint set; set one of json, regex, choice, grammar, "
        "json_object or structural_tag."
    )


def _json_spec(schema: dict | bool, params: StructuredOutputsParams) -> str:
    """xgrammar compiles schemas strictly (no properties the schema does not list, unless it
    says ``additionalProperties``), as vLLM's xgrammar backend does; so
    ``disable_additional_properties`` (for vLLM's guidance backend) changes no grammar here."""
    return json.dumps(
        {"schema": schema, "any_whitespace": not params.disable_any_whitespace}, sort_keys=True
    )


class StructuredOutputGrammar(Protocol):
    """One request's matcher over a compiled grammar."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool: ...

    def fill_bitmask(self, bitmask, index: int) -> None: ...

    def is_terminated(self) -> bool: ...


class StructuredOutputRequest:
    """Rides on a core ``Request``: the constraint's key and the request's own matcher."""

    def __init__(self, key: StructuredOutputKey, grammar: StructuredOutputGrammar) -> None:
        self.key = key
        self.grammar = grammar
