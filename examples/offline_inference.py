"""Offline batch inference with pagedlm: the vLLM script, with one import changed.

    python examples/offline_inference.py --model /path/to/hf_model_dir

Without --model it builds a tiny random-weight Qwen2 model in a temporary directory, so the
command runs on a machine with no model at all (its answers are random text).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from pagedlm import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def _demo_model() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import make_tiny_model

    path = Path(tempfile.mkdtemp(prefix="pagedlm-demo-"))
    print(f"No --model given: using a tiny random-weight model in {path}")
    return str(make_tiny_model(path, "qwen2"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Hugging Face model directory")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    llm = LLM(model=args.model or _demo_model(), max_model_len=512)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
    for output in llm.generate(PROMPTS, params):
        print(f"Prompt: {output.prompt!r}\nGenerated: {output.outputs[0].text!r}\n")


if __name__ == "__main__":
    main()
