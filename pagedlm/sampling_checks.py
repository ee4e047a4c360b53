"""The checks of a SamplingParams: its ranges when it is built (vLLM's order and messages),
and, at admission, against the model (vocabulary size, max_logprobs).

Functions of a SamplingParams (named `self`, as they read like its methods); a failure raises
ValueError / TypeError or VLLMValidationError naming the parameter.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NoReturn

from pagedlm.exceptions import VLLMValidationError
from pagedlm.sampling_options import is_int, verify_num_sequences

if TYPE_CHECKING:
    from pagedlm.sampling_params import SamplingParams

MAX_LOGPROB_TOKEN_IDS = 128
"""Upper bound on ``len(SamplingParams.logprob_token_ids)``."""


def reject(self: SamplingParams, name: str, message: str, value: Any = None) -> NoReturn:
    """Raise VLLMValidationError for field ``name`` (``value`` defaults to the field's)."""
    value = getattr(self, name) if value is None else value
    raise VLLMValidationError(message, parameter=name, value=value)


def verify_sampling_args(self: SamplingParams) -> None:
    """The construction-time range checks, in vLLM's order."""
    verify_num_sequences(self.n, "n")
    if not -2.0 <= self.presence_penalty <= 2.0:
        raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
    if not -2.0 <= self.frequency_penalty <= 2.0:
        raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
    if not math.isfinite(self.repetition_penalty):
        raise ValueError(
            f"repetition_penalty must be a finite number, got {self.repetition_penalty}."
        )
    if self.repetition_penalty <= 0.0:
        raise ValueError(
            f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
        )
    t = self.temperature
    if not math.isfinite(t):
        reject(self, "temperature", f"temperature must be a finite number, got {t}.")
    if t < 0.0:
        reject(self, "temperature", f"temperature must be non-negative, got {t}.")
    if not 0.0 < self.top_p <= 1.0:
        reject(self, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
    if not is_int(self.top_k):
        raise TypeError(f"top_k must be an integer, got {type(self.top_k).__name__}")
    if self.top_k < -1:  # -1 is quietly accepted as "disabled", like 0
        raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
    if not 0.0 <= self.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
    if self.max_tokens is not None and self.max_tokens < 1:
        reject(self, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
    if self.min_tokens < 0:
        raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
    if self.max_tokens is not None and self.min_tokens > self.max_tokens:
        raise ValueError(
            f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
            f"got {self.min_tokens}."
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(self, name)
        if value is not None and value != -1 and value < 0:
            reject(self, name, f"{name} must be non-negative or -1, got {value}.")
    assert isinstance(self.stop_token_ids, list)
    if not all(is_int(token_id) for token_id in self.stop_token_ids):
        raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
    assert isinstance(self.stop, list)
    if any(not stop_str for stop_str in self.stop):
        raise ValueError("stop cannot contain an empty string.")
    if self.stop and not self.detokenize:
        raise ValueError(
            "stop strings are only supported when detokenize is True. "
            "Set detokenize=True to use stop."
        )
    assert isinstance(self.bad_words, list)
    if any(not word for word in self.bad_words):
        raise ValueError(
            f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}"
        )


def verify_against_model(self: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """Engine-time checks against the model: logprob counts and token-id ranges.

    ``max_logprobs == -1`` and ``logprobs``/``prompt_logprobs == -1`` mean ``vocab_size``.
    """
    if max_logprobs == -1:
        max_logprobs = vocab_size
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        requested = getattr(self, name)
        if not requested:
            continue
        if requested == -1:
            requested = vocab_size
        if requested > max_logprobs:
            reject(
                self,
                name,
                f"Requested {kind} logprobs of {requested}, which is greater than max "
                f"allowed: {max_logprobs}",
                requested,
            )
    if self.logprob_token_ids is not None:
        count = len(self.logprob_token_ids)
        if count > MAX_LOGPROB_TOKEN_IDS:
            reject(
                self,
                "logprob_token_ids",
                f"Requested logprob_token_ids of length {count}, which is greater than max "
                f"allowed: {MAX_LOGPROB_TOKEN_IDS}",
                count,
            )
        _check_in_vocab(self, "logprob_token_ids", self.logprob_token_ids, vocab_size)
        if self.logprobs is not None and self.logprobs != count:
            reject(
                self,
                "logprob_token_ids",
                "When both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids). Got logprobs={self.logprobs}, "
                f"len(logprob_token_ids)={count}.",
                count,
            )
    if self.stop_token_ids:
        _check_in_vocab(self, "stop_token_ids", self.stop_token_ids, vocab_size)
    if self.logit_bias:
        _check_in_vocab(self, "logit_bias", list(self.logit_bias), vocab_size)
    if self.allowed_token_ids is not None:
        if len(self.allowed_token_ids) == 0:
            reject(self, "allowed_token_ids", "allowed_token_ids is not None and empty!")
        invalid = [t for t in self.allowed_token_ids if t < 0 or t >= vocab_size]
        if invalid:
            msg = "allowed_token_ids contains out-of-vocab token id!"
            reject(self, "allowed_token_ids", msg, invalid)


def _check_in_vocab(self: SamplingParams, name: str, token_ids: list[int], vocab_size: int) -> None:
    invalid = [t for t in token_ids if t < 0 or t >= vocab_size]
    if invalid:
        msg = f"token_id(s) {invalid} in {name} contain out-of-vocab token ids."
        reject(self, name, f"{msg} Vocabulary size: {vocab_size}", invalid)
