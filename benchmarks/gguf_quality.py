"""Packed GGUF (quantization="gguf", integer kernels) against the dequantized bf16 path on the
same file: greedy agreement over 10 prompts, perplexity on a fixed text, peak RSS.

    .venv/bin/python benchmarks/gguf_quality.py [--model qwen2.5-coder-0.5b-instruct]

Each path runs in its own process (PAGEDLM_GGUF_DEQUANTIZE=1 for bf16), so peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "def quicksort(arr):",
    "Write a SQL query that counts orders per customer.",
    "What is the difference between a list and a tuple in Python?",
    "Write a bash one-liner that counts lines in all .py files.",
    "class LinkedList:\n    def __init__(self):",
    "Translate to JavaScript: print(sum(x * x for x in range(10)))",
    "Write a C function that reverses a string in place.",
    "What does the `yield` keyword do in Python?",
]
MAX_TOKENS = 48


def fixed_text() -> str:
    """The text perplexity is measured on: this repository's sampling_params.py (code, as the
    default model is a code model), first 6000 characters."""
    return (ROOT / "pagedlm" / "sampling_params.py").read_text()[:6000]


def worker(model: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    from pagedlm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, max_model_len=4096, seed=0)
    load_s = time.perf_counter() - start
    tok = llm.get_tokenizer()
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(chats, greedy, use_tqdm=False)
    generate_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ids = tok(fixed_text())["input_ids"]
    scored = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    lps = [d[t].logprob for d, t in zip(scored.prompt_logprobs[1:], ids[1:])]
    result = {
        "load_s": load_s,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "ppl": math.exp(-sum(lps) / len(lps)),
        "ppl_tokens": len(lps),
        "peak_rss_mb_generate": generate_rss,  # load + 10 greedy requests
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # + ppl
    }
    Path(out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write both results here")
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.out)
        return
    results = {}
    for mode in ("gguf", "bf16"):
        env = dict(os.environ, PAGEDLM_GGUF_DEQUANTIZE="1" if mode == "bf16" else "0")
        out = f"/tmp/pagedlm_gguf_quality_{mode}_{os.getpid()}.json"
        cmd = [sys.executable, __file__, "--worker", mode, "--out", out, "--model", args.model]
        subprocess.run(cmd, env=env, check=True)
        results[mode] = json.loads(Path(out).read_text())
        Path(out).unlink()
    q, b = results["gguf"], results["bf16"]
    same = sum(x == y for x, y in zip(q["tokens"], b["tokens"]))
    prefix = [
        next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        for x, y in zip(q["tokens"], b["tokens"])
    ]
    print(
        f"greedy: {same}/{len(PROMPTS)} identical completions ({MAX_TOKENS} tokens max); "
        f"common prefix per prompt: {prefix}"
    )
    rel = (q["ppl"] - b["ppl"]) / b["ppl"]
    print(
        f"perplexity ({q['ppl_tokens']} tokens): gguf {q['ppl']:.4f}, bf16 {b['ppl']:.4f} "
        f"({rel:+.2%})"
    )
    print(
        f"peak RSS MB after load + generate: gguf {q['peak_rss_mb_generate']:.0f}, bf16 "
        f"{b['peak_rss_mb_generate']:.0f}; with the perplexity pass (its logits): gguf "
        f"{q['peak_rss_mb']:.0f}, bf16 {b['peak_rss_mb']:.0f}; "
        f"load s: gguf {q['load_s']:.1f}, bf16 {b['load_s']:.1f}"
    )
    for i, (x, y) in enumerate(zip(q["texts"], b["texts"])):
        if x != y:
            print(f"--- prompt {i}\n  gguf: {x!r}\n  bf16: {y!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
