"""Sampling parameters for text generation (the ``vllm.sampling_params`` surface).

``SamplingParams`` is a plain dataclass: keyword construction, unknown keywords raise
``TypeError``, and ``__post_init__`` normalises then validates the fields in vLLM's order.
Engine-time checks that need the model (vocab size, ``max_logprobs``) live in ``verify``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any, NoReturn, Protocol

from pagedlm.sampling_checks import reject, verify_against_model, verify_sampling_args
from pagedlm.sampling_options import (
    BeamSearchParams,
    RepetitionDetectionParams,
    RequestOutputKind,
    StructuredOutputsParams,
    check_field_types,
    convert_logit_bias,
    validate_thinking_token_budget,
)

__all__ = [
    "BeamSearchParams",
    "RepetitionDetectionParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def __len__(self) -> int: ...


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


_REPR_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "bad_words", "thinking_token_budget",
    "include_stop_str_in_output", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
    "structured_outputs", "extra_args",
)  # fmt: skip
"""The fields vLLM's ``SamplingParams.__repr__`` shows, in its order."""

_OPTIONAL_DEFAULTS: dict[str, float] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
}


@dataclass
class SamplingParams:
    """Sampling parameters for one generation request (vLLM-compatible).

    After ``__post_init__``: ``stop``, ``stop_token_ids`` and ``bad_words`` are lists, ``seed`` is
    never -1, ``logprobs``/``prompt_logprobs`` are never ``True``, ``temperature`` is 0 or
    >= 0.01, greedy requests have ``top_p == 1``, ``top_k == 0``, ``min_p == 0`` and ``n == 1``,
    and ``skip_reading_prefix_cache`` is a bool.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_clone: bool = False
    # Internal: set by __post_init__ / the engine, not meant as inputs.
    output_text_buffer_length: int = 0
    _eos_token_id: int | None = field(default=None, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    routed_experts_prompt_start: int = 0
    # vLLM fields pagedlm refuses (unless at their default) when a request uses them:
    # sampling_options.check_unsupported_fields
    watermarking: bool | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    stream_interval: int | None = None
    trace_decode_token_ids: Any = None
    logits_processors: Any = None  # vLLM v0's; not in v1: a ValueError saying what replaced it

    @staticmethod
    def from_optional(
        n: int | None = 1,
        presence_penalty: float | None = 0.0,
        frequency_penalty: float | None = 0.0,
        repetition_penalty: float | None = 1.0,
        temperature: float | None = 1.0,
        top_p: float | None = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        bad_words: list[str] | None = None,
        thinking_token_budget: int | None = None,
        include_stop_str_in_output: bool = False,
        ignore_eos: bool = False,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        detokenize: bool = True,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        structured_outputs: StructuredOutputsParams | None = None,
        logit_bias: dict[int, float] | dict[str, float] | None = None,
        allowed_token_ids: list[int] | None = None,
        extra_args: dict[str, Any] | None = None,
        skip_clone: bool = False,
        repetition_detection: RepetitionDetectionParams | None = None,
        logprob_token_ids: list[int] | None = None,
        routed_experts_prompt_start: int = 0,
        watermarking: bool | None = None,
        prompt_logprob_token_ids: Any = None,
        prompt_logprob_start: int | None = None,
        stream_interval: int | None = None,
        trace_decode_token_ids: Any = None,
    ) -> SamplingParams:
        """Like the constructor, but None for n/penalties/temperature/top_p means the default.

        ``logit_bias`` keys are converted with ``int()`` and values clamped to [-100, 100].
        """
        kwargs = dict(locals())  # exactly the parameters above
        for name, default in _OPTIONAL_DEFAULTS.items():
            if kwargs[name] is None:
                kwargs[name] = default
        kwargs["logit_bias"] = convert_logit_bias(logit_bias)
        return SamplingParams(**kwargs)

    def __post_init__(self) -> None:
        for name, default in _OPTIONAL_DEFAULTS.items():  # None means the default, as in vLLM
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.check_types()
        if self.logits_processors is not None:
            raise ValueError(
                "SamplingParams(logits_processors=...) is vLLM v0's: v1 (and pagedlm) have no "
                "per-request logits processors. Use logit_bias, allowed_token_ids, bad_words, "
                "min_tokens or structured_outputs, which run inside the sampler."
            )
        if 0 < self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors nan or inf in "
                "tensors. We have maxed it out to %s.",
                self.temperature,
                _MAX_TEMP,
                _MAX_TEMP,
            )
            self.temperature = _MAX_TEMP
        if self.seed == -1:
            self.seed = None
        self.thinking_token_budget = validate_thinking_token_budget(self.thinking_token_budget)

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = (
            [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        )
        self.bad_words = [] if self.bad_words is None else list(dict.fromkeys(self.bad_words))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1

        # Characters held back from streamed text until stop strings can be ruled out.
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

        self._verify_args()

        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters are meaningless, and n > 1 would give n identical samples.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

        # The engine adds the EOS id(s) here too (update_from_generation_config).
        self._all_stop_token_ids.update(self.stop_token_ids)
        if self.skip_reading_prefix_cache is None:
            # Prefix-cache hits would skip the prompt positions whose logprobs were requested.
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None

    def check_types(self) -> None:
        """Raise TypeError naming the first field whose value has a type it does not accept;
        integral values (numpy's too) become ``int`` and real ones ``float``."""
        check_field_types(self)

    def _reject(self, name: str, message: str, value: Any = None) -> NoReturn:
        reject(self, name, message, value)

    def _verify_args(self) -> None:
        verify_sampling_args(self)

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """Merge the model's EOS ids: the primary one becomes ``eos_token_id`` (unless
        ``ignore_eos``); extra ones from ``generation_config`` join ``stop_token_ids``."""
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)  # so min_tokens masks it
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        extra = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        if eos_token_id is not None:
            extra.discard(eos_token_id)  # the primary EOS is handled separately
        if not extra:
            return
        self._all_stop_token_ids.update(extra)
        if not self.ignore_eos:
            assert self.stop_token_ids is not None
            extra.update(self.stop_token_ids)
            self.stop_token_ids = list(extra)

    def update_from_tokenizer(self, tokenizer: _Tokenizer) -> None:
        """Tokenize ``bad_words`` into ``_bad_words_token_ids``.

        Each word is encoded without special tokens as-is (leading whitespace stripped) and with
        one leading space; the spaced variant is kept only when it is a different token sequence
        of the same length. Every id must lie in [0, max_token_id].
        """
        if not self.bad_words:
            return
        token_ids: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                self._reject("bad_words", "bad_words entries must tokenize to at least one token.")
            token_ids.append(plain)
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                token_ids.append(spaced)
        max_token_id = getattr(tokenizer, "max_token_id", None)
        if max_token_id is None:
            max_token_id = len(tokenizer) - 1
        invalid = [t for ids in token_ids for t in ids if t < 0 or t > max_token_id]
        if invalid:
            self._reject(
                "bad_words",
                f"The model vocabulary size is {max_token_id + 1}, but the following tokens were "
                f"specified as bad: {invalid}. All token id values should be integers "
                f"satisfying: 0 <= token_id <= {max_token_id}.",
            )
        self._bad_words_token_ids = token_ids

    def normalize_for_engine(self, vocab_size: int) -> None:
        """Make the engine's copy (at admission, once) what the workers read: greedy is
        temperature 0.0 (tested as `== 0`), a logprob count of -1 is `vocab_size`."""
        if self.temperature < _SAMPLING_EPS:
            self.temperature = 0.0
        if self.logprobs == -1:
            self.logprobs = vocab_size
        if self.prompt_logprobs == -1:
            self.prompt_logprobs = vocab_size

    def verify(self, *, max_logprobs: int, vocab_size: int) -> None:
        """Engine-time checks against the model: logprob counts and token-id ranges."""
        verify_against_model(self, max_logprobs, vocab_size)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    @property
    def num_logprobs(self) -> int | None:
        """Sample logprobs per token: ``logprobs``, else ``len(logprob_token_ids)``, else None."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    def clone(self) -> SamplingParams:
        """A deep copy, or a shallow one when ``skip_clone`` is set."""
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={getattr(self, name)}" for name in _REPR_FIELDS)
        return f"SamplingParams({args})"


# vLLM's SamplingParams is a msgspec Struct; clients (outlines) copy one through this tuple.
SamplingParams.__struct_fields__ = tuple(f.name for f in fields(SamplingParams))  # type: ignore[attr-defined]
