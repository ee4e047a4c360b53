"""Offline data parallelism: vLLM's data-parallel example with pagedlm imports.

    python examples/data_parallel.py --dp-size 2                    # packaged default model
    python examples/data_parallel.py --model /path/to/model --dp-size 2 --tp-size 1 \
        --output results.json

Each data-parallel rank is a separate engine process: it is started with VLLM_DP_RANK,
VLLM_DP_RANK_LOCAL, VLLM_DP_SIZE, VLLM_DP_MASTER_IP and VLLM_DP_MASTER_PORT set (vLLM's
convention), generates its share of the prompts and sends its outputs back; the parent prints
them in prompt order (and writes them to --output). On several nodes, run the script on each
with --node-size / --node-rank / --master-addr: every node serves and reports its own ranks.
Each rank may itself be tensor parallel (--tp-size), with its share of the CPUs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue

from pagedlm import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
] * 10


def shard(items: list, rank: int, size: int) -> range:
    """Indices of `items` for `rank`: contiguous, sizes differing by at most one."""
    per_rank, remainder = divmod(len(items), size)
    start = rank * per_rank + min(rank, remainder)
    return range(start, start + per_rank + (rank < remainder))


def run_rank(args: argparse.Namespace, dp_rank: int, local_rank: int, results: mp.Queue) -> None:
    os.environ.update(
        VLLM_DP_RANK=str(dp_rank),
        VLLM_DP_RANK_LOCAL=str(local_rank),
        VLLM_DP_SIZE=str(args.dp_size),
        VLLM_DP_MASTER_IP=args.master_addr,
        VLLM_DP_MASTER_PORT=str(args.master_port),
    )
    if args.cpus_per_rank:  # this rank's share of the machine's CPUs
        first = local_rank * args.cpus_per_rank
        os.sched_setaffinity(0, range(first, first + args.cpus_per_rank))
    indices = shard(PROMPTS, dp_rank, args.dp_size)
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = llm.generate([PROMPTS[i] for i in indices], params, use_tqdm=False)
    results.put((dp_rank, [(i, o.outputs[0].text) for i, o in zip(indices, outputs, strict=True)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dp-size", type=int, default=2, help="Data-parallel ranks in all.")
    parser.add_argument("--tp-size", type=int, default=1, help="Tensor-parallel size per rank.")
    parser.add_argument("--node-size", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29555)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus-per-rank", type=int, default=0, help="Pin ranks (0: no).")
    parser.add_argument("--output", help="Write {prompt index: text} as JSON here.")
    args = parser.parse_args()
    if args.dp_size % args.node_size:
        parser.error("--dp-size must be a multiple of --node-size")
    ranks_per_node = args.dp_size // args.node_size
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = []
    for local_rank in range(ranks_per_node):
        dp_rank = args.node_rank * ranks_per_node + local_rank
        proc = ctx.Process(target=run_rank, args=(args, dp_rank, local_rank, results))
        proc.start()
        procs.append(proc)
    texts: dict[int, str] = {}
    reported = 0
    while reported < len(procs):
        try:
            dp_rank, outputs = results.get(timeout=1)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"a data-parallel rank failed (exit code {failed[0]})") from None
            continue
        print(f"DP rank {dp_rank}: {len(outputs)} prompts")
        texts.update(outputs)
        reported += 1
    for proc in procs:
        proc.join()
    for i in sorted(texts):
        print(f"Prompt: {PROMPTS[i]!r}, Generated text: {texts[i]!r}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({str(i): texts[i] for i in sorted(texts)}, f, indent=1)


if __name__ == "__main__":
    main()
