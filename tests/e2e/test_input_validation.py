"""Bad input is refused before anything is queued, naming the argument; the engine serves on.

Each case of the table is a value that once passed validation and failed inside a step (or
gave a bare interpreter message); the property-based test draws many more. After every
refusal a fixed greedy request must return the tokens it returned before.
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.sampling_params import RepetitionDetectionParams, RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPT = [5, 6, 7]
# Hypothesis examples per engine; PAGEDLM_FUZZ_EXAMPLES=2000 for a long run.
FUZZ_EXAMPLES = int(os.environ.get("PAGEDLM_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    return LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _assert_serving(llm: LLM, reference: list[int]) -> None:
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference


BAD_SAMPLING = [
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"seed": True}, TypeError, "seed must be an int"),
    ({"seed": "42"}, TypeError, "seed must be an int"),
    ({"logprobs": 1.5}, TypeError, "logprobs must be an int"),
    ({"logprobs": "5"}, TypeError, "logprobs must be an int"),
    ({"prompt_logprobs": 1.5}, TypeError, "prompt_logprobs must be an int"),
    ({"temperature": "hot"}, TypeError, "temperature must be a number"),
    ({"max_tokens": "16"}, TypeError, "max_tokens must be an int"),
    ({"max_tokens": 1.5}, TypeError, "max_tokens must be an int"),
    ({"stop": 5}, TypeError, "stop must be a string"),
    ({"stop": [1, 2]}, TypeError, "stop must be a string"),
    ({"bad_words": 5}, TypeError, "bad_words must be a list of strings"),
    ({"bad_words": [5]}, TypeError, "bad_words must be a list of strings"),
    ({"bad_words": "word"}, TypeError, "bad_words must be a list of strings"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a list"),
    ({"logit_bias": {1: math.nan}}, ValueError, "logit_bias values must be finite"),
    ({"logit_bias": {"x": 1.0}}, TypeError, "logit_bias must be a dict"),
    ({"output_kind": "x"}, TypeError, "output_kind must be a RequestOutputKind"),
    ({"ignore_eos": "no"}, TypeError, "ignore_eos must be True or False"),
    ({"n": 2.0}, TypeError, "n must be an int"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_SAMPLING, ids=lambda v: repr(v)[:40])
def test_bad_sampling_params_name_the_field(llm, reference, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)
    # a field set after construction is checked again when the request is added
    params = SamplingParams(max_tokens=4)
    for name, value in kwargs.items():
        setattr(params, name, value)
    with pytest.raises(error, match=match):
        llm.llm_engine.add_request("late", PROMPT, params)
    _assert_serving(llm, reference)


def test_none_means_the_default_and_numpy_ints_are_ints() -> None:
    import numpy as np

    params = SamplingParams(temperature=None, top_p=None, seed=np.int64(3), max_tokens=np.int32(5))
    assert params.temperature == 1.0 and params.top_p == 1.0
    assert type(params.seed) is int and type(params.max_tokens) is int
    assert SamplingParams(logprobs=True).logprobs == 1
    delta = RequestOutputKind.DELTA
    assert SamplingParams(output_kind=delta).output_kind is delta


BAD_CALLS = [
    (lambda llm: llm.generate(None, use_tqdm=False), TypeError, "prompts must be"),
    (lambda llm: llm.generate(12345, use_tqdm=False), TypeError, "prompts must be"),
    (lambda llm: llm.generate(["a"], "greedy", use_tqdm=False), TypeError, "must be a Sampling"),
    (lambda llm: llm.generate([[1.5, 2]], GREEDY, use_tqdm=False), TypeError, "must be ints"),
    (
        lambda llm: llm.generate({"prompt_token_ids": [1, True]}, GREEDY, use_tqdm=False),
        TypeError,
        "must be ints",
    ),
    (
        lambda llm: llm.generate([PROMPT], GREEDY, priority=[5], use_tqdm=False),
        ValueError,
        "Priority scheduling is not enabled",
    ),
    (
        lambda llm: llm.generate([PROMPT], GREEDY, priority=["a"], use_tqdm=False),
        TypeError,
        "priority must be an int",
    ),
]


@pytest.mark.parametrize("call,error,match", BAD_CALLS)
def test_bad_prompts_and_arguments(llm, reference, call, error, match) -> None:
    with pytest.raises(error, match=match):
        call(llm)
    _assert_serving(llm, reference)


def test_too_long_prompt_gives_the_requested_output_tokens(llm) -> None:
    with pytest.raises(ValueError, match="you requested 10 output tokens .* for a total of 210"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=10), use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"max_model_len": 0}, ValueError, "max_model_len must be at least 1, got 0"),
        ({"max_model_len": -5}, ValueError, "max_model_len must be at least 1, got -5"),
        ({"block_size": 0}, ValueError, "block_size must be at least 1"),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be at least 1"),
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens must be at least"),
        ({"max_num_seqs": 2.5}, TypeError, "max_num_seqs must be an int"),
        ({"tensor_parallel_size": True}, TypeError, "tensor_parallel_size must be an int"),
        ({"model": None}, TypeError, "model must be"),
        ({"model": ""}, TypeError, "model must be"),
    ],
)
def test_engine_sizes_are_refused_by_name(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        EngineArgs(**kwargs)


# ------------------------------------------------------------------ fuzz
_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-5, 600), max_size=3),
    st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.integers(-3, 600), st.floats(allow_nan=True), max_size=2),
)
_FIELDS = [
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words",
    "skip_special_tokens", "include_stop_str_in_output", "output_kind",
]  # fmt: skip
_PROMPTS = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=8),
    st.lists(st.integers(-3, 600), max_size=6),
    st.lists(st.floats(allow_nan=True), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=4), min_size=1, max_size=2),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(-1, 600), max_size=4)}),
    st.just([7] * 300),  # longer than max_model_len
)


def _fuzz(llm: LLM, reference: list[int], draws: st.DataObject) -> None:
    kwargs = draws.draw(st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=4))
    prompt = draws.draw(_PROMPTS)
    try:
        params = SamplingParams(**kwargs)
        if params.max_tokens is None or params.max_tokens > 8:
            params.max_tokens = 8  # keep each draw short
        llm.generate(prompt, params, use_tqdm=False)
    except (TypeError, ValueError):
        assert not llm.llm_engine.has_unfinished_requests(), "a refused call left requests"
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(draws=st.data())
def test_fuzz_sampling_params_and_prompts(llm, reference, draws) -> None:
    _fuzz(llm, reference, draws)


@pytest.fixture(scope="module")
def mp_llm(tiny_qwen2):
    return LLM(
        str(tiny_qwen2),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        distributed_executor_backend="mp",
    )


@settings(
    max_examples=max(FUZZ_EXAMPLES // 3, 5),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(draws=st.data())
def test_fuzz_multiprocess_engine(mp_llm, reference, draws) -> None:
    _fuzz(mp_llm, reference, draws)  # the same weights: the in-process engine's tokens


def test_broken_chat_template_is_named(llm, reference) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat_template passed in cannot be rendered"):
        llm.chat(messages, chat_template="{% if %}", use_tqdm=False)
    _assert_serving(llm, reference)


def test_lora_errors_carry_no_terminal_colour_codes() -> None:
    from pagedlm.lora.adapter import _fail
    from pagedlm.lora.request import LoRARequest

    error = _fail(LoRARequest("a", 1, "/x"), "\x1b[31mcannot read\x1b[0m the weights")
    assert str(error) == "LoRA adapter 'a' (/x): cannot read the weights"


REFUSED = [
    (lambda llm: llm.generate([PROMPT], SamplingParams(thinking_token_budget=10)), "thinking"),
    (
        lambda llm: llm.generate(
            [PROMPT],
            SamplingParams(
                repetition_detection=RepetitionDetectionParams(max_pattern_size=3, min_count=2)
            ),
        ),
        "repetition_detection",
    ),
]


@pytest.mark.parametrize("call,match", REFUSED)
def test_features_pagedlm_lacks_are_refused_by_name(llm, reference, call, match) -> None:
    """Options vLLM has and pagedlm cannot honour raise NotImplementedError naming them
    (they were accepted and ignored); the engine serves on."""
    with pytest.raises(NotImplementedError, match=match):
        call(llm)
    _assert_serving(llm, reference)


def test_reasoning_parser_and_device_are_refused_by_name(monkeypatch) -> None:
    from pagedlm.config import StructuredOutputsConfig
    from pagedlm.platforms import _detect

    with pytest.raises(NotImplementedError, match="reasoning_parser"):
        StructuredOutputsConfig.from_any({"reasoning_parser": "deepseek_r1"})
    monkeypatch.setenv("PAGEDLM_DEVICE", "tpu")
    with pytest.raises(ValueError, match="PAGEDLM_DEVICE='tpu': use auto, cpu or cuda"):
        _detect()
    monkeypatch.setenv("PAGEDLM_DEVICE", "cpu")
    assert type(_detect()).__name__ == "CpuPlatform"


def test_attention_config_at_vllms_default_is_accepted() -> None:
    """vLLM's pooling test fixtures pass attention_config=None; a real config is refused."""
    assert EngineArgs(attention_config=None).attention_config is None
    with pytest.raises(NotImplementedError, match="attention_config="):
        EngineArgs(attention_config={"backend": "FLASH_ATTN"})
