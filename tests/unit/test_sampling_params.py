"""SamplingParams: defaults, normalisation, validation, and the engine-facing helpers."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from pagedlm.exceptions import VLLMValidationError
from pagedlm.sampling_params import (
    _MAX_TEMP,
    _SAMPLING_EPS,
    BeamSearchParams,
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)
from tests.tiny_tokenizer import build_tiny_tokenizer

PUBLIC_FIELD_ORDER = [
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "prompt_logprobs", "logprob_token_ids", "flat_logprobs", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "skip_clone", "output_text_buffer_length", "structured_outputs", "logit_bias",
    "allowed_token_ids", "extra_args", "bad_words", "skip_reading_prefix_cache",
    "thinking_token_budget", "repetition_detection",
]  # fmt: skip


def test_constants() -> None:
    assert _SAMPLING_EPS == 1e-5
    assert _MAX_TEMP == 1e-2


def test_defaults() -> None:
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.max_tokens == 16 and sp.min_tokens == 0
    assert sp.seed is None and sp.logprobs is None and sp.prompt_logprobs is None
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.bad_words == []
    assert sp.detokenize and sp.skip_special_tokens and sp.spaces_between_special_tokens
    assert not sp.ignore_eos and not sp.include_stop_str_in_output and not sp.flat_logprobs
    assert sp.output_kind is RequestOutputKind.CUMULATIVE
    assert sp.output_text_buffer_length == 0
    assert sp.skip_reading_prefix_cache is False
    assert sp.eos_token_id is None and sp.all_stop_token_ids == set()
    assert sp.bad_words_token_ids is None
    assert sp.sampling_type is SamplingType.RANDOM
    assert sp.num_logprobs is None


def test_field_order_and_private_fields() -> None:
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    public = [name for name in fields if not name.startswith("_")]
    assert public[: len(PUBLIC_FIELD_ORDER)] == PUBLIC_FIELD_ORDER
    assert {"_eos_token_id", "_all_stop_token_ids", "_bad_words_token_ids"} <= set(fields)
    # Each instance gets its own stop-id set.
    a, b = SamplingParams(stop_token_ids=[5]), SamplingParams()
    assert a.all_stop_token_ids == {5} and b.all_stop_token_ids == set()


def test_unknown_kwarg_raises_type_error() -> None:
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        SamplingParams(use_beam_search=True)  # type: ignore[call-arg]


def test_enums() -> None:
    assert [k.value for k in RequestOutputKind] == [0, 1, 2]
    assert [k.name for k in RequestOutputKind] == ["CUMULATIVE", "DELTA", "FINAL_ONLY"]
    assert (SamplingType.GREEDY, SamplingType.RANDOM, SamplingType.RANDOM_SEED) == (0, 1, 2)


VLLM_ERRORS = {"temperature", "top_p", "max_tokens", "logprobs", "prompt_logprobs"}

INVALID_CASES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"n": 0}, ValueError, "n must be at least 1, got 0."),
    ({"n": 1.5}, TypeError, "n must be an int"),
    ({"n": 16385}, ValueError, "n must be at most 16384"),
    ({"presence_penalty": 2.5}, ValueError, r"presence_penalty must be in \[-2, 2\], got 2.5."),
    ({"frequency_penalty": -2.1}, ValueError, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty must be greater than zero"),
    ({"repetition_penalty": float("inf")}, ValueError, "repetition_penalty must be a finite"),
    ({"temperature": -1.0}, VLLMValidationError, "temperature must be non-negative, got -1.0."),
    ({"temperature": float("nan")}, VLLMValidationError, "temperature must be a finite number"),
    ({"top_p": 0}, VLLMValidationError, r"top_p must be in \(0, 1\], got 0."),
    ({"top_p": 1.5}, VLLMValidationError, r"top_p must be in \(0, 1\], got 1.5."),
    ({"top_k": -2}, ValueError, r"top_k must be 0 \(disable\), or at least 1, got -2."),
    ({"top_k": 1.5}, TypeError, "top_k must be an integer, got float"),
    ({"min_p": 1.5}, ValueError, r"min_p must be in \[0, 1\], got 1.5."),
    ({"max_tokens": 0}, VLLMValidationError, "max_tokens must be at least 1, got 0."),
    ({"min_tokens": -1}, ValueError, "min_tokens must be greater than or equal to 0, got -1."),
    ({"min_tokens": 5, "max_tokens": 4}, ValueError, "min_tokens must be less than or equal to"),
    ({"logprobs": -2}, VLLMValidationError, "logprobs must be non-negative or -1, got -2."),
    ({"prompt_logprobs": -5}, VLLMValidationError, "prompt_logprobs must be non-negative or -1"),
    ({"stop_token_ids": [1, "x"]}, ValueError, "stop_token_ids must contain only integers"),
    ({"stop": ["ok", ""]}, ValueError, "stop cannot contain an empty string."),
    ({"stop": "x", "detokenize": False}, ValueError, "only supported when detokenize is True"),
    ({"bad_words": ["ok", ""]}, ValueError, "bad_words cannot contain an empty string."),
    ({"thinking_token_budget": -3}, ValueError, "`thinking_token_budget` must be a non-negative"),
    ({"temperature": 0.0, "n": 2}, ValueError, "n must be 1 when using greedy sampling, got 2."),
]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    INVALID_CASES,
    ids=["-".join(f"{k}={v}" for k, v in case[0].items()) for case in INVALID_CASES],
)
def test_invalid_args(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match) as info:
        SamplingParams(**kwargs)
    if exc is VLLMValidationError:
        (name,) = set(kwargs) & VLLM_ERRORS
        assert info.value.parameter == name
        assert info.value.value == kwargs[name] or kwargs[name] != kwargs[name]  # NaN


def test_validation_error_is_value_error_with_extras() -> None:
    err = VLLMValidationError("bad", parameter="top_p", value=0)
    assert isinstance(err, ValueError)
    assert (err.parameter, err.value) == ("top_p", 0)
    assert str(err) == "bad (parameter=top_p, value=0)"
    assert str(VLLMValidationError("plain")) == "plain"


def test_valid_edge_values() -> None:
    sp = SamplingParams(top_k=-1, presence_penalty=-2.0, frequency_penalty=2.0, min_p=1.0)
    assert sp.top_k == -1  # quietly accepted as "disabled"
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(logprobs=-1, prompt_logprobs=0).logprobs == -1
    assert SamplingParams(top_k=5).top_k == 5


def test_greedy_forces_filters_off() -> None:
    sp = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.3)
    assert (sp.top_p, sp.top_k, sp.min_p) == (1.0, 0, 0.0)
    assert sp.sampling_type is SamplingType.GREEDY


def test_small_temperature_is_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedlm.sampling_params"):
        sp = SamplingParams(temperature=0.001, top_k=3)
    assert sp.temperature == _MAX_TEMP and sp.top_k == 3
    assert sp.sampling_type is SamplingType.RANDOM
    assert "temperature 0.001 is less than 0.01" in caplog.text


def test_normalisation() -> None:
    sp = SamplingParams(seed=-1, stop="END", logprobs=True, prompt_logprobs=True)
    assert sp.seed is None
    assert sp.stop == ["END"]
    assert sp.logprobs == 1 and sp.prompt_logprobs == 1
    assert sp.output_text_buffer_length == 2
    assert sp.skip_reading_prefix_cache is True
    assert sp.num_logprobs == 1
    assert SamplingParams(seed=7).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(stop_token_ids=[3, 4, 3]).stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=[3, 4]).all_stop_token_ids == {3, 4}
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(logprob_token_ids=[1, 2]).num_logprobs == 2


def test_output_text_buffer_length() -> None:
    assert SamplingParams(stop=["a", "abcd"]).output_text_buffer_length == 3
    assert (
        SamplingParams(stop=["abc"], include_stop_str_in_output=True).output_text_buffer_length == 0
    )


def test_skip_reading_prefix_cache_explicit() -> None:
    assert (
        SamplingParams(prompt_logprobs=2, skip_reading_prefix_cache=False).skip_reading_prefix_cache
        is False
    )
    assert SamplingParams(skip_reading_prefix_cache=True).skip_reading_prefix_cache is True


def test_from_optional() -> None:
    sp = SamplingParams.from_optional(
        n=None, presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
        temperature=None, top_p=None, logit_bias={"5": 250.0, 7: -300.0, "9": 1.5},
    )  # fmt: skip
    assert (sp.n, sp.temperature, sp.top_p) == (1, 1.0, 1.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.logit_bias == {5: 100.0, 7: -100.0, 9: 1.5}
    assert SamplingParams.from_optional(temperature=0.5, max_tokens=3).max_tokens == 3
    with pytest.raises(VLLMValidationError, match="cannot be converted"):
        SamplingParams.from_optional(logit_bias={"abc": 1.0})
    with pytest.raises(VLLMValidationError):
        SamplingParams.from_optional(top_p=0)


def test_clone() -> None:
    sp = SamplingParams(stop=["x"], extra_args={"k": [1]})
    other = sp.clone()
    assert other == sp and other is not sp
    assert other.stop is not sp.stop and other.extra_args["k"] is not sp.extra_args["k"]
    shallow = SamplingParams(stop=["x"], skip_clone=True).clone()
    assert shallow.skip_clone
    sp2 = SamplingParams(stop=["x"], skip_clone=True)
    assert sp2.clone().stop is sp2.stop
    assert copy.deepcopy(sp) == sp


def test_repr() -> None:
    text = repr(SamplingParams(temperature=0.5, stop="Z"))
    assert text.startswith("SamplingParams(n=1, presence_penalty=0.0, frequency_penalty=0.0, ")
    assert "temperature=0.5, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=['Z']" in text
    assert "max_tokens=16" in text and text.endswith("extra_args=None)")
    assert "_eos_token_id" not in text


def test_update_from_generation_config() -> None:
    sp = SamplingParams(stop_token_ids=[9])
    sp.update_from_generation_config({"eos_token_id": [2, 5]}, eos_token_id=2)
    assert sp.eos_token_id == 2
    assert sorted(sp.stop_token_ids) == [5, 9]
    assert sp.all_stop_token_ids == {2, 5, 9}

    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({"eos_token_id": [2, 5]}, eos_token_id=2)
    assert ignoring.eos_token_id is None
    assert ignoring.stop_token_ids == []
    assert ignoring.all_stop_token_ids == {2, 5}  # still used for min_tokens masking

    single = SamplingParams()
    single.update_from_generation_config({"eos_token_id": 2}, eos_token_id=2)
    assert single.stop_token_ids == [] and single.all_stop_token_ids == {2}
    plain = SamplingParams()
    plain.update_from_generation_config({}, eos_token_id=None)
    assert plain.eos_token_id is None and plain.all_stop_token_ids == set()


def test_verify_logprobs() -> None:
    SamplingParams(logprobs=20, prompt_logprobs=20).verify(max_logprobs=20, vocab_size=100)
    with pytest.raises(
        VLLMValidationError,
        match="Requested sample logprobs of 21, which is greater than max allowed: 20",
    ):
        SamplingParams(logprobs=21).verify(max_logprobs=20, vocab_size=100)
    with pytest.raises(
        VLLMValidationError,
        match="Requested prompt logprobs of 100, which is greater than max allowed: 20",
    ):
        SamplingParams(prompt_logprobs=-1).verify(max_logprobs=20, vocab_size=100)
    SamplingParams(logprobs=-1, prompt_logprobs=-1).verify(max_logprobs=-1, vocab_size=100)
    SamplingParams(logprobs=0).verify(max_logprobs=0, vocab_size=100)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logit_bias": {100: 1.0}},
        {"logit_bias": {-1: 1.0}},
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"allowed_token_ids": [10_000_000]},
        {"stop_token_ids": [100]},
        {"logprob_token_ids": [1, 200]},
        {"logprob_token_ids": list(range(129))},
        {"logprob_token_ids": [1, 2], "logprobs": 1},
    ],
)
def test_verify_token_ids(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).verify(max_logprobs=20, vocab_size=100)


def test_verify_accepts_in_range_ids() -> None:
    SamplingParams(
        logit_bias={0: 1.0, 99: -1.0}, allowed_token_ids=[0, 99], stop_token_ids=[5],
        logprob_token_ids=[1, 2], logprobs=2,
    ).verify(max_logprobs=20, vocab_size=100)  # fmt: skip


def test_bad_words_with_tokenizer(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer(tmp_path)
    words = ["Paris", " capital of", "the"]
    sp = SamplingParams(bad_words=words)
    sp.update_from_tokenizer(tok)
    # Each word as-is (leading space stripped), then its " word" variant when that is a different
    # token sequence of the same length (a word-initial form of the same word).
    expected: list[list[int]] = []
    for word in words:
        plain = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        expected.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            expected.append(spaced)
    assert sp.bad_words_token_ids == expected
    assert len(expected) > len(words)  # the tiny vocab gives "Paris" a spaced variant
    assert all(0 <= t < len(tok) for seq in expected for t in seq)


def test_bad_words_none_is_noop(tmp_path: Path) -> None:
    sp = SamplingParams()
    sp.update_from_tokenizer(build_tiny_tokenizer(tmp_path))
    assert sp.bad_words_token_ids is None


class _FakeTokenizer:
    def __init__(self, ids: list[int], size: int = 10) -> None:
        self.ids, self.size = ids, size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return list(self.ids) if not text.startswith(" ") else [i + 1 for i in self.ids]

    def __len__(self) -> int:
        return self.size


def test_bad_words_out_of_range_and_empty() -> None:
    with pytest.raises(VLLMValidationError, match="specified as bad"):
        SamplingParams(bad_words=["w"]).update_from_tokenizer(_FakeTokenizer([50]))
    with pytest.raises(VLLMValidationError, match="at least one token"):
        SamplingParams(bad_words=["w"]).update_from_tokenizer(_FakeTokenizer([]))
    sp = SamplingParams(bad_words=["w"])
    sp.update_from_tokenizer(_FakeTokenizer([3, 4]))
    assert sp.bad_words_token_ids == [[3, 4], [4, 5]]


def test_structured_outputs_params() -> None:
    so = StructuredOutputsParams(choice=["a", "b"])
    assert not so.all_constraints_none()
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    with pytest.raises(ValueError, match="only use one kind"):
        StructuredOutputsParams(regex="a+", json_object=True)
    with pytest.raises(ValueError, match="must use one kind"):
        StructuredOutputsParams()


def test_repetition_detection_params() -> None:
    RepetitionDetectionParams()
    RepetitionDetectionParams(max_pattern_size=4, min_pattern_size=1, min_count=3)
    with pytest.raises(ValueError):
        RepetitionDetectionParams(max_pattern_size=2, min_pattern_size=3, min_count=2)
    with pytest.raises(ValueError, match="min_count must be >= 2"):
        RepetitionDetectionParams(max_pattern_size=2, min_count=1)


def test_beam_search_params() -> None:
    bp = BeamSearchParams(beam_width=2, max_tokens=8)
    assert (bp.ignore_eos, bp.temperature, bp.length_penalty) == (False, 0.0, 1.0)
    assert bp.include_stop_str_in_output is False
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=0, max_tokens=8)


def test_normalize_for_engine_resolves_minus_one_and_greedy_once() -> None:
    """The engine's copy at admission: what every worker-side reader relies on."""
    params = SamplingParams(temperature=0.0, logprobs=-1, prompt_logprobs=-1)
    params.normalize_for_engine(vocab_size=50)
    assert (params.temperature, params.logprobs, params.prompt_logprobs) == (0.0, 50, 50)
    params = SamplingParams(temperature=0.7, logprobs=3)
    params.normalize_for_engine(vocab_size=50)
    assert (params.temperature, params.logprobs, params.prompt_logprobs) == (0.7, 3, None)
