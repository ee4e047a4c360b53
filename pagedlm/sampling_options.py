"""Parameter objects that ride on ``SamplingParams`` (structured outputs, repetition
detection, the output kind) or sit next to it (``BeamSearchParams``), and the field checks
they share, the type checks of every ``SamplingParams`` field among them.

``pagedlm.sampling_params`` re-exports the classes, where vLLM users import them from.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NoReturn

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
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True  # when decoding each beam's text
    watermarking: bool | None = None

    def __post_init__(self) -> None:
        verify_num_sequences(self.beam_width, "beam_width")
        if self.structured_outputs is not None:
            raise NotImplementedError(
                "BeamSearchParams.structured_outputs is not supported by pagedlm yet; use "
                "LLM.generate with SamplingParams(structured_outputs=...) instead."
            )
        if self.watermarking:
            raise NotImplementedError(
                "BeamSearchParams.watermarking=True: pagedlm applies no watermark; leave it None."
            )


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


class RequestOutputKind(Enum):
    """What each ``RequestOutput`` of a request carries."""

    CUMULATIVE = 0  # the whole output so far
    DELTA = 1  # only the newly generated part
    FINAL_ONLY = 2  # one output, at the end


_INT_FIELDS = ("n", "min_tokens", "routed_experts_prompt_start")  # top_k: _verify_args
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens")
_LOGPROBS_FIELDS = ("logprobs", "prompt_logprobs")  # an int, None, or True (one)
_FLOAT_FIELDS = (
    "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p",
)  # fmt: skip
_BOOL_FIELDS = (
    "ignore_eos", "flat_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "skip_clone",
)  # fmt: skip
_TOKEN_ID_LIST_FIELDS = ("allowed_token_ids", "logprob_token_ids")  # stop_token_ids: below


def is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is no token id, seed or count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_list_of(value: Any, check: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str | bytes)
        and all(check(item) for item in value)
    )


def _anything(value: Any) -> bool:
    return True


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _wrong_type(name: str, accepted: str, value: Any) -> NoReturn:
    raise TypeError(
        f"SamplingParams.{name} must be {accepted}, got {type(value).__name__} {value!r:.80}."
    )


def check_field_types(params: Any) -> None:
    """SamplingParams' type checks (`SamplingParams.check_types`): TypeError naming the first
    field whose value has a type it does not accept; integral values become ``int``, real ones
    ``float``."""
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS + _LOGPROBS_FIELDS:
        value = getattr(params, name)
        if value is None and name not in _INT_FIELDS:
            continue
        if value is True and name in _LOGPROBS_FIELDS:
            continue
        if not is_int(value):
            accepted = "an int" if name in _INT_FIELDS else "an int or None"
            _wrong_type(name, accepted, value)
        setattr(params, name, int(value))
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not _is_real(value):
            _wrong_type(name, "a number", value)
        setattr(params, name, float(value))
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(params, name), bool):
            _wrong_type(name, "True or False", getattr(params, name))
    for name in _TOKEN_ID_LIST_FIELDS:
        value = getattr(params, name)
        if value is not None and not _is_list_of(value, is_int):
            _wrong_type(name, "a list of int token ids or None", value)
    if params.stop_token_ids is not None and not _is_list_of(params.stop_token_ids, _anything):
        _wrong_type("stop_token_ids", "a list of int token ids or None", params.stop_token_ids)
    stop = params.stop
    if not (stop is None or isinstance(stop, str) or _is_list_of(stop, _is_str)):
        _wrong_type("stop", "a string, a list of strings or None", stop)
    if not (params.bad_words is None or _is_list_of(params.bad_words, _is_str)):
        _wrong_type("bad_words", "a list of strings or None", params.bad_words)
    bias = params.logit_bias
    if bias is not None:
        if not isinstance(bias, dict) or not all(is_int(k) for k in bias):
            _wrong_type("logit_bias", "a dict of int token id -> number, or None", bias)
        if not all(_is_real(v) and math.isfinite(v) for v in bias.values()):
            raise VLLMValidationError(
                "logit_bias values must be finite numbers.", parameter="logit_bias", value=bias
            )
    if not isinstance(params.output_kind, RequestOutputKind):
        _wrong_type("output_kind", "a RequestOutputKind", params.output_kind)
    optional_types: dict[str, type] = {
        "structured_outputs": StructuredOutputsParams,
        "repetition_detection": RepetitionDetectionParams,
        "extra_args": dict,
        "skip_reading_prefix_cache": bool,
    }
    for name, kind in optional_types.items():
        value = getattr(params, name)
        if value is not None and not isinstance(value, kind):
            _wrong_type(name, f"a {kind.__name__} or None", value)


_UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "thinking_token_budget": ((None,), "it needs a reasoning parser"),
    "watermarking": ((None, False), "pagedlm applies no watermark"),
    "prompt_logprob_token_ids": ((None,), "vLLM itself needs its V2 model runner for it"),
    "prompt_logprob_start": ((None,), "it selects rows for prompt_logprob_token_ids"),
    "stream_interval": ((None, 1), "every step's tokens are streamed"),
    "trace_decode_token_ids": ((None,), "decode tracing is not implemented"),
    "routed_experts_prompt_start": ((0,), "pagedlm has no mixture-of-experts models"),
}
"""SamplingParams fields a request may carry only at these values (vLLM's default first)."""


def same_value(value: Any, accepted: Any) -> bool:
    """``value == accepted``, keeping True apart from 1 and False from 0 (arrays never equal)."""
    if value is accepted:
        return True
    if isinstance(value, bool) or isinstance(accepted, bool) or accepted is None:
        return False
    try:
        return bool(value == accepted)
    except (TypeError, ValueError):  # an array compares elementwise
        return False


def check_unsupported_fields(params: Any) -> None:
    """NotImplementedError naming the first vLLM field pagedlm cannot honour at its value."""
    for name, (accepted, why) in _UNSUPPORTED_FIELDS.items():
        value = getattr(params, name)
        if not any(same_value(value, a) for a in accepted):
            raise NotImplementedError(
                f"SamplingParams.{name}={value!r:.60} is not supported by pagedlm yet ({why}); "
                f"leave it {' or '.join(map(repr, accepted))}."
            )
    detection = params.repetition_detection
    if detection is not None and detection.max_pattern_size:
        raise NotImplementedError(
            "SamplingParams.repetition_detection is not supported by pagedlm yet; leave it "
            "None (or max_pattern_size=0)."
        )
