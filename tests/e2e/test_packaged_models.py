"""The packaged GGUF models against outputs recorded with transformers (fp32, same file).

Fixtures come from scripts/record_model_fixtures.py. Marked slow: each loads a real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from pagedlm import LLM, SamplingParams

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]


def _fixture(name: str) -> dict:
    path = FIXTURES / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"no fixture {path.name}; run scripts/record_model_fixtures.py")
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_packaged_model_matches_transformers(name: str, monkeypatch) -> None:
    """The recorded outputs are transformers' on the dequantized file: compare that path (the
    packed-GGUF default quantizes activations, see benchmarks/gguf_quality.py)."""
    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", "1")
    fixture = _fixture(name)
    llm = LLM(name, dtype="float32", max_model_len=512)
    tokenizer = llm.get_tokenizer()
    cases = fixture["cases"]
    # The tokenizer is transformers' conversion of the GGUF's, whose major versions differ
    # (transformers 4 makes Gemma's a Unigram one, 5 the BPE one): compare within a major.
    same_major = fixture["transformers"].split(".")[0] == transformers.__version__.split(".")[0]
    for case in cases:  # our tokenizer (converted from the GGUF) encodes like transformers'
        if "prompt" in case and same_major:
            assert tokenizer.encode(case["prompt"]) == case["prompt_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=fixture["max_tokens"], ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": c["prompt_token_ids"]} for c in cases], params, use_tqdm=False
    )
    for case, out in zip(cases, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == case["token_ids"], case.get("prompt", "chat")
    chat_cases = [c for c in cases if "chat" in c]
    for case in chat_cases if same_major else []:
        out = llm.chat(case["chat"], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == case["prompt_token_ids"]
        assert list(out.outputs[0].token_ids) == case["token_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("dequantize", ["0", "1"], ids=["packed-gguf", "bf16"])
def test_default_model_answers(dequantize: str, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", dequantize)
    llm = LLM("qwen2.5-coder-0.5b-instruct", max_model_len=1024)
    out = llm.chat(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        SamplingParams(temperature=0.0, max_tokens=48),
        use_tqdm=False,
    )[0]
    assert "def " in out.outputs[0].text
