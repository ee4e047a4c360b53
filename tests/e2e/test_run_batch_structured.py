"""`pagedlm run-batch` with OpenAI's `response_format` (and vLLM's `structured_outputs` field).

On the tiny random model every constrained answer is the grammar's doing; whitespace is
disabled engine-wide (--structured-outputs-config) so JSON answers end within max_tokens.
"""

from __future__ import annotations

import json
import re

import pytest

from pagedlm.entrypoints.openai.run_batch import main
from tests.e2e.test_run_batch import CHAT, COMPLETIONS, chat, line, read_results

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}


def json_schema(schema: dict, name: str = "answer", **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, **extra}}


@pytest.fixture(scope="module")
def engine_args(tiny_qwen2) -> list[str]:
    return [
        "--model", str(tiny_qwen2), "--max-model-len", "128", "--dtype", "float32",
        "--structured-outputs-config", '{"disable_any_whitespace": true}',
    ]  # fmt: skip


def test_response_format_and_errors(tmp_path, engine_args) -> None:
    sample = {"temperature": 1.0, "max_tokens": 60}
    lines = [
        line("schema-1", CHAT, chat("Is it ok?", response_format=json_schema(SCHEMA), seed=1,
                                    **sample)),
        line("schema-2", CHAT, chat("Level?", response_format=json_schema(SCHEMA, strict=True),
                                    temperature=0, max_tokens=60)),
        line("object-1", CHAT, chat("Any JSON", response_format={"type": "json_object"},
                                    seed=2, temperature=1.0, max_tokens=12)),
        line("text-1", CHAT, chat("hi", response_format={"type": "text"}, max_tokens=3)),
        line("regex-1", COMPLETIONS, {"prompt": "Code:", "structured_outputs":
                                      {"regex": "[A-F]{2}-[0-9]{3}"}, "max_tokens": 20}),
        line("bad-type", CHAT, chat("x", response_format={"type": "xml"})),  # 6
        line("bad-name", CHAT, chat("x", response_format=json_schema(SCHEMA, name="a b"))),
        line("no-schema", CHAT, chat("x", response_format={"type": "json_schema",
                                                           "json_schema": {"name": "n"}})),
        line("bad-schema", CHAT, chat("x", response_format=json_schema({"type": "foo"}))),
        line("both", CHAT, chat("x", response_format={"type": "json_object"},
                                structured_outputs={"regex": "a"})),  # 10
        line("guided", COMPLETIONS, {"prompt": "x", "guided_json": SCHEMA}),
        line("bad-so", COMPLETIONS, {"prompt": "x", "structured_outputs": {"regexp": "a"}}),
        line("bad-regex", COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "(a"}}),
    ]  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert main(["-i", str(inp), "-o", str(out), *engine_args]) == 1
    results = read_results(out)
    ok = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in results if not r["error"]}
    errors = {r["error"]["line"]: r["error"]["message"] for r in results if r["error"]}
    assert set(ok) == {"schema-1", "schema-2", "object-1", "text-1", "regex-1"}

    for key in ("schema-1", "schema-2"):
        assert ok[key]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(ok[key]["message"]["content"]), SCHEMA)
    obj = ok["object-1"]
    assert obj["message"]["content"].startswith(("{", "["))
    if obj["finish_reason"] == "stop":
        json.loads(obj["message"]["content"])
    assert ok["regex-1"]["finish_reason"] == "stop"
    assert re.fullmatch("[A-F]{2}-[0-9]{3}", ok["regex-1"]["text"])

    expected = {
        6: "response_format.type",
        7: "json_schema.name",
        8: "json_schema.schema",
        9: "Invalid json",
        10: "not both",
        11: "guided_* fields were removed",
        12: "unknown field(s) ['regexp']",
        13: "Invalid regex",
    }
    assert set(errors) == set(expected)
    for lineno, words in expected.items():
        assert words in errors[lineno], (lineno, errors[lineno])
