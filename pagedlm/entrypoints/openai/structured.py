"""OpenAI `response_format` (and vLLM's `structured_outputs` body field) -> StructuredOutputsParams.

`response_format` as OpenAI defines it: `{"type": "text"}` (no constraint),
`{"type": "json_object"}` (any JSON object) or `{"type": "json_schema", "json_schema": {"name":
..., "description": ..., "schema": {...}, "strict": ...}}`. Whether the schema itself is valid is
decided by the engine when the request is added (a ValueError becomes the line's error).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedlm.sampling_options import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FIELDS = set(StructuredOutputsParams.__dataclass_fields__) - {"_backend", "_backend_was_auto"}


class StructuredOutputsError(ValueError):
    """The body's structured-output fields are malformed (message names the field)."""


def _describe(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def structured_outputs_from_body(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The constraint a request body asks for, or None; StructuredOutputsError if malformed."""
    response_format = body.get("response_format")
    structured = body.get("structured_outputs")
    from_format = _from_response_format(response_format)
    from_field = _from_structured_outputs(structured)
    if from_format is not None and from_field is not None:
        raise StructuredOutputsError(
            "Set either 'response_format' or 'structured_outputs', not both."
        )
    return from_format or from_field


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StructuredOutputsError(
            "'response_format' must be an object with a 'type' (text, json_object or "
            f"json_schema), got {_describe(value)}."
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise StructuredOutputsError(
            f"'response_format.type' must be text, json_object or json_schema, got {kind!r}."
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredOutputsError(
            "'response_format' of type json_schema needs a 'json_schema' object "
            f'({{"name": ..., "schema": {{...}}}}), got {_describe(spec)}.'
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise StructuredOutputsError(
            "'response_format.json_schema.name' must be 1-64 characters of a-z, A-Z, 0-9, _ "
            f"or -, got {_describe(name)}."
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredOutputsError(
            f"'response_format.json_schema.strict' must be true, false or null, got "
            f"{_describe(strict)}."
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise StructuredOutputsError(
            "'response_format.json_schema.schema' must be a JSON schema object, got "
            f"{_describe(schema)}."
        )
    return StructuredOutputsParams(json=schema)


def _from_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StructuredOutputsError(
            f"'structured_outputs' must be an object, got {_describe(value)}."
        )
    unknown = sorted(set(value) - _FIELDS)
    if unknown:
        raise StructuredOutputsError(
            f"'structured_outputs' has unknown field(s) {unknown}; known: {sorted(_FIELDS)}."
        )
    try:
        return StructuredOutputsParams(**value)
    except (ValueError, TypeError) as e:
        raise StructuredOutputsError(f"'structured_outputs': {e}") from e
