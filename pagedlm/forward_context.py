"""Per-step data the attention layers read without threading it through every `forward`.

The model runner sets it around one forward pass; nesting is an error, and it is always reset.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_forward_context: Any = None


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _forward_context
    assert _forward_context is None, "forward contexts do not nest"
    _forward_context = attn_metadata
    try:
        yield
    finally:
        _forward_context = None


def get_attn_metadata() -> Any:
    assert _forward_context is not None, "attention called outside set_forward_context()"
    return _forward_context
