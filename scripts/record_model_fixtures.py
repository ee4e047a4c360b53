"""Record reference greedy outputs of the packaged models with Hugging Face transformers.

transformers loads the same GGUF file (dequantized, fp32) through its own GGUF support; the
greedy token ids it generates are written to tests/fixtures/<model>.json and checked by
tests/e2e/test_packaged_models.py (marked slow). Run after changing prompts:

    .venv/bin/pip install -e ".[dev]"
    .venv/bin/python scripts/record_model_fixtures.py [qwen2.5-coder-0.5b-instruct gemma-3-270m]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedlm.model_loader.catalog import resolve_packaged_model  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "# Sort a list of numbers in Python\n",
    "Once upon a time, in a land far away,",
]
CHAT = [{"role": "user", "content": "Write a function that reverses a string."}]
MAX_TOKENS = 24


def record(name: str) -> None:
    path = resolve_packaged_model(name)
    assert path is not None, name
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    print(f"{name}: transformers loaded in {time.time() - start:.0f}s")
    cases = [{"prompt": p, "prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        cases.append(
            {"chat": CHAT, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        )
    with torch.no_grad():
        for case in cases:
            ids = torch.tensor([case["prompt_token_ids"]])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.eos_token_id,
            )
            case["token_ids"] = out[0, ids.shape[1] :].tolist()
            case["text"] = tokenizer.decode(case["token_ids"])
            print(repr(case.get("prompt", "chat")), "->", repr(case["text"]))
    fixture = {
        "model": name,
        "max_tokens": MAX_TOKENS,
        "dtype": "float32",
        "transformers": __import__("transformers").__version__,
        "cases": cases,
    }
    out_path = ROOT / "tests" / "fixtures" / f"{name}.json"
    out_path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print("wrote", out_path)


if __name__ == "__main__":
    for model_name in sys.argv[1:] or ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]:
        record(model_name)
