"""Speculative decoding (n-gram drafts) on an editing workload: speed-up and acceptance.

    python benchmarks/spec_decode.py                      # batch 1 and 16, k = 3
    python benchmarks/spec_decode.py --batch-sizes 1,16 --num-speculative-tokens 4

The prompts ask the packaged default model to rewrite a function with comments, so most of
the answer repeats the prompt: the case prompt lookup is made for. Each row is one engine run
with drafts off, then on; output tokens/s counts generated tokens over the generate() time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedlm import LLM, SamplingParams  # noqa: E402

FUNCTIONS = [
    """def merge_sorted(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out""",
    """def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])""",
    """def binary_search(xs, target):
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1""",
    """def flatten(nested):
    result = []
    stack = [nested]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            result.append(item)
    return result""",
]


def conversations(n: int) -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": "Rewrite this function with a comment on every line. Keep the code "
                f"exactly the same.\n\n```python\n{FUNCTIONS[i % len(FUNCTIONS)]}\n```",
            }
        ]
        for i in range(n)
    ]


def run(model: str, batch: int, max_tokens: int, spec: dict | None) -> dict:
    llm = LLM(
        model,
        max_model_len=2048,
        speculative_config=spec,
        disable_log_stats=False,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(conversations(2), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.chat(conversations(batch), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    engine = llm.llm_engine.stat_logger._labels["engine"]
    metrics = {
        m.name: m
        for m in llm.get_metrics()
        if "spec_decode" in m.name and m.labels.get("engine") == engine
    }
    result = {
        "out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    if spec is not None:
        drafts = metrics["vllm:spec_decode_num_draft_tokens"].value
        accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
        result["acceptance"] = accepted / max(drafts, 1)
        result["per_pos"] = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    args = parser.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    print("| batch | off: out tok/s | ngram: out tok/s | speed-up | acceptance | same tokens |")
    print("|---|---|---|---|---|---|")
    for batch in map(int, args.batch_sizes.split(",")):
        off = run(args.model, batch, args.max_tokens, None)
        on = run(args.model, batch, args.max_tokens, spec)
        same = sum(a == b for a, b in zip(off["tokens"], on["tokens"], strict=True))
        print(
            f"| {batch} | {off['out_tok_s']:.1f} | {on['out_tok_s']:.1f} | "
            f"{on['out_tok_s'] / off['out_tok_s']:.2f}x | {on['acceptance']:.0%} "
            f"(per position {on['per_pos']}) | {same}/{batch} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
