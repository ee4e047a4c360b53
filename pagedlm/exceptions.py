"""Exceptions shared across pagedlm (mirrors ``vllm.exceptions``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class VLLMValidationError(ValueError):
    """A request-validation failure.

    It is a ``ValueError`` so that ``except ValueError`` callers keep working. ``parameter`` names
    the offending argument and ``value`` holds what was rejected; both are optional and, when set,
    are appended to ``str(exc)`` as ``" (parameter=..., value=...)"``.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        base = super().__str__()
        extras: list[str] = []
        if self.parameter is not None:
            extras.append(f"parameter={self.parameter}")
        if self.value is not None:
            extras.append(f"value={self.value}")
        return f"{base} ({', '.join(extras)})" if extras else base


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an error inside a step, or shutdown); no request can run.

    Mirrors ``vllm.v1.engine.exceptions.EngineDeadError``.
    """


class EngineGenerateError(RuntimeError):
    """A single request failed; the engine keeps running (vLLM's name)."""


@contextmanager
def blame_request(request_id: str) -> Iterator[None]:
    """An exception raised inside is noted as caused by `request_id` (`failed_request_ids`,
    which survives pickling): a failed step then fails that request alone."""
    try:
        yield
    except Exception as e:
        if getattr(e, "failed_request_ids", None) is None:
            e.failed_request_ids = [request_id]  # type: ignore[attr-defined]
        raise
