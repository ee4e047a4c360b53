"""Structured outputs on the packaged default model: every output satisfies its constraint.

Slow: loads the real 0.5B model. 20 JSON-schema requests must parse and validate 20/20; regex
and choice outputs must full-match, under greedy and random sampling.
"""

from __future__ import annotations

import json
import re

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.sampling_params import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

_STR = {"type": "string", "maxLength": 40}
_INT = {"type": "integer", "minimum": 0, "maximum": 100000}
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"name": _STR, "age": _INT}),
    ("a book", {"title": _STR, "author": _STR, "year": _INT}),
    ("a city", {"city": _STR, "country": _STR, "population": _INT}),
    ("a product", {"name": _STR, "price": {"type": "number"}, "in_stock": {"type": "boolean"}}),
    ("a movie", {"title": _STR, "rating": {"type": "number", "minimum": 0, "maximum": 10}}),
    ("a color", {"name": _STR, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    ("a user account", {"username": _STR, "email": _STR, "active": {"type": "boolean"}}),
    ("a point", {"x": {"type": "number"}, "y": {"type": "number"}}),
    ("a task", {"title": _STR, "priority": {"enum": ["low", "medium", "high"]}}),
    ("a pet", {"species": {"enum": ["cat", "dog", "bird"]}, "name": _STR}),
    ("a file", {"path": _STR, "size_bytes": _INT}),
    ("a recipe", {"dish": _STR, "ingredients": {"type": "array", "items": _STR, "maxItems": 4}}),
    ("a team", {"name": _STR, "members": {"type": "array", "items": _STR, "maxItems": 3}}),
    ("an HTTP response", {"status": {"type": "integer", "enum": [200, 404, 500]}, "body": _STR}),
    ("a date", {"year": _INT, "month": {"type": "integer", "minimum": 1, "maximum": 12}}),
    ("a language", {"name": _STR, "typed": {"type": "boolean"}}),
    ("a car", {"make": _STR, "model": _STR, "electric": {"type": "boolean"}}),
    ("a planet", {"name": _STR, "moons": _INT}),
    ("a song", {"title": _STR, "artist": _STR, "seconds": _INT}),
    (
        "an order",
        {
            "id": _INT,
            "customer": {
                "type": "object",
                "properties": {"name": _STR},
                "required": ["name"],
                "additionalProperties": False,
            },
        },
    ),
]


def _schema(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _chat(llm: LLM, text: str) -> dict:
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return {"prompt_token_ids": tok.encode(prompt, add_special_tokens=False)}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("qwen2.5-coder-0.5b-instruct", max_model_len=1024)


@pytest.mark.slow
def test_json_schemas_validate(llm: LLM) -> None:
    schemas = [_schema(props) for _, props in SCHEMAS]
    prompts = [
        _chat(llm, f"Describe {what} as a JSON object with the fields {', '.join(props)}.")
        for what, props in SCHEMAS
    ]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for i, schema in enumerate(schemas)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    valid = 0
    for schema, out in zip(schemas, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
        valid += 1
    assert valid == 20


@pytest.mark.slow
def test_regex_and_choice_full_match(llm: LLM) -> None:
    regexes = [
        (r"\d{3}-\d{4}", "Give a phone number."),
        (r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}", "Name a famous scientist."),
        (r"(true|false)", "Is the sky blue?"),
        (r"[a-z_]{1,16}\([a-z, ]{0,16}\)", "Write a Python function call."),
        (r"\d{4}-\d{2}-\d{2}", "Give today's date."),
    ]  # bounded patterns: the grammar itself must end before max_tokens
    choices = ["positive", "negative", "neutral"]
    prompts, params, checks = [], [], []
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        for pattern, question in regexes:
            prompts.append(_chat(llm, question))
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=seed,
                    max_tokens=40,
                    structured_outputs=StructuredOutputsParams(regex=pattern),
                )
            )
            checks.append(lambda text, p=pattern: re.fullmatch(p, text) is not None)
        for review in ("I loved it!", "Terrible service.", "It was fine."):
            prompts.append(_chat(llm, f"Classify the sentiment: {review}"))
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=seed,
                    max_tokens=10,
                    structured_outputs=StructuredOutputsParams(choice=choices),
                )
            )
            checks.append(lambda text: text in choices)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for check, out in zip(checks, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and check(completion.text), completion
