"""outlines' VLLMOffline (`outlines.from_vllm_offline(LLM(...))`), unchanged, on pagedlm."""

from __future__ import annotations

import re

import pytest

from tests.ecosystem.conftest import result_line

pytest.importorskip("outlines")

CLIENT = """
import json, sys
import outlines
from outlines.types import Regex
from pydantic import BaseModel
from vllm import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="float32", max_model_len=128)
model = outlines.from_vllm_offline(llm)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompts = ["Hello, my name is", "The capital of France is"]
one = model(prompts[0], sampling_params=params)
batch = model.batch(prompts, sampling_params=params)
# The tokenizer has a chat template, so outlines sends each prompt as one user message.
ref = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


class Person(BaseModel):
    name: str


structured = {}
grammar_params = SamplingParams(temperature=0.0, max_tokens=64)
for name, output_type in [("json", Person), ("regex", Regex(r"[0-9]{3}"))]:
    try:
        structured[name] = {"text": model("Hello", output_type, sampling_params=grammar_params)}
    except Exception as e:
        structured[name] = {"error": f"{type(e).__name__}: {e}"}
print("RESULT " + json.dumps(dict(
    one=one, batch=batch, ref=[r.outputs[0].text for r in ref], structured=structured
)))
"""


def test_outlines_vllm_offline_plain_text_matches_llm_chat(run_client, tiny_qwen2) -> None:
    got = result_line(run_client(CLIENT, args=(tiny_qwen2,)))
    assert got["one"] == got["ref"][0]
    assert got["batch"] == [[text] for text in got["ref"]]
    assert all(len(text) >= 4 for text in got["ref"])
    structured = got["structured"]
    assert "error" not in structured["regex"], structured["regex"]
    assert re.fullmatch(r"[0-9]{3}", structured["regex"]["text"])
    # the random tiny model may not close the object within max_tokens; what it wrote follows
    # the schema's grammar (full schema validation: tests/e2e/test_structured_outputs_model.py)
    assert "error" not in structured["json"], structured["json"]
    assert re.match(r'\{\s*"name"\s*(:|$)', structured["json"]["text"])
