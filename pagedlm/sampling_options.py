"""Parameter objects that ride on ``SamplingParams`` (structured outputs, repetition
detection) or sit next to it (``BeamSearchParams``), and the field checks they share.

``pagedlm.sampling_params`` re-exports the classes, where vLLM users import them from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedlm import envs
from pagedlm.exceptions import VLLMValidationError

_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Structured-output constraint; exactly one constraint field must be set."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    _backend: str | None = field(default=None, init=False, repr=False)
    _backend_was_auto: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        count = sum(getattr(self, name) is not None for name in _CONSTRAINT_FIELDS)
        if count > 1:
            raise VLLMValidationError(
                "You can only use one kind of structured outputs constraint "
                f"but multiple are specified: {self.__dict__}"
            )
        if count < 1:
            raise VLLMValidationError(
                "You must use one kind of structured outputs constraint "
                f"but none are specified: {self.__dict__}"
            )

    def all_constraints_none(self) -> bool:
        """True when no constraint field is set."""
        return all(getattr(self, name) is None for name in _CONSTRAINT_FIELDS)


@dataclass
class RepetitionDetectionParams:
    """N-gram repetition detection; ``max_pattern_size == 0`` disables it.

    Invariants: sizes >= 0, ``min_pattern_size <= max_pattern_size``, and ``min_count >= 2``
    whenever detection is enabled.
    """

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        if (
            self.max_pattern_size < 0
            or self.min_pattern_size < 0
            or self.min_pattern_size > self.max_pattern_size
        ):
            raise VLLMValidationError(
                "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
                "max_pattern_size. Set both to 0 to disable repetitive pattern detection."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise VLLMValidationError(
                "min_count must be >= 2 to detect repetitive patterns in engine output. If you "
                "do not wish to detect repetitive patterns, set max_pattern_size to 0."
            )


@dataclass
class BeamSearchParams:
    """Parameters of ``LLM.beam_search``; ``beam_width`` is an int >= 1."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        verify_num_sequences(self.beam_width, "beam_width")


def verify_num_sequences(value: Any, name: str) -> None:
    """``value`` must be an int in [1, VLLM_MAX_N_SEQUENCES]."""
    if not isinstance(value, int):
        raise TypeError(f"{name} must be an int, but is of type {type(value)}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")
    max_n = envs.VLLM_MAX_N_SEQUENCES
    if value > max_n:
        raise ValueError(
            f"{name} must be at most {max_n}, got {value}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )


def validate_thinking_token_budget(value: Any) -> int | None:
    """A non-negative int, or -1 / None meaning unlimited (stored as None)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise VLLMValidationError(
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
            parameter="thinking_token_budget",
            value=value,
        )
    return None if value == -1 else value


def convert_logit_bias(
    logit_bias: dict[int, float] | dict[str, float] | None,
) -> dict[int, float] | None:
    """int() the keys (VLLMValidationError if one cannot be) and clamp values to [-100, 100]."""
    if logit_bias is None:
        return None
    bias: dict[int, float] = {}
    bad_keys: list[Any] = []
    for token, value in logit_bias.items():
        try:
            bias[int(token)] = min(100.0, max(-100.0, value))
        except (TypeError, ValueError):
            bad_keys.append(token)
    if bad_keys:
        msg = "logit_bias contains key(s) that cannot be converted to integer token IDs"
        msg = f"{msg}: {bad_keys!r}"
        raise VLLMValidationError(msg, parameter="logit_bias", value=bad_keys)
    return bias
