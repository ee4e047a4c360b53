"""outlines' VLLMOffline (`outlines.from_vllm_offline(LLM(...))`), unchanged, on pagedlm."""

from __future__ import annotations

import json
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

# Compact JSON: a random tiny model would otherwise fill max_tokens with whitespace.
llm = LLM(sys.argv[1], dtype="float32", max_model_len=128,
          structured_outputs_config={"disable_any_whitespace": True})
model = outlines.from_vllm_offline(llm)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompts = ["Hello, my name is", "The capital of France is"]
one = model(prompts[0], sampling_params=params)
batch = model.batch(prompts, sampling_params=params)
# The tokenizer has a chat template, so outlines sends each prompt as one user message.
ref = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


class Answer(BaseModel):
    ok: bool


structured = {}
long = SamplingParams(temperature=0.0, max_tokens=64)
for name, output_type in [("json", Answer), ("regex", Regex(r"[0-9]{3}"))]:
    try:
        structured[name] = {"text": model("Hello", output_type, sampling_params=long)}
    except Exception as e:
        structured[name] = {"error": f"{type(e).__name__}: {e}"}
print("RESULT " + json.dumps(dict(
    one=one, batch=batch, ref=[r.outputs[0].text for r in ref], structured=structured
)))
"""


def test_outlines_vllm_offline_text_and_structured_outputs(run_client, tiny_qwen2) -> None:
    got = result_line(run_client(CLIENT, args=(tiny_qwen2,)))
    assert got["one"] == got["ref"][0]
    assert got["batch"] == [[text] for text in got["ref"]]
    assert all(len(text) >= 4 for text in got["ref"])
    structured = got["structured"]
    assert re.fullmatch(r"[0-9]{3}", structured["regex"]["text"]), structured
    assert isinstance(json.loads(structured["json"]["text"])["ok"], bool), structured
