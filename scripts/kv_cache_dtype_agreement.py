"""Greedy agreement of an fp8 KV cache with the model-dtype cache on the default model.

    PYTHONPATH=. .venv/bin/python scripts/kv_cache_dtype_agreement.py --kv-cache-dtype fp8

Generates greedily from the same prompts twice (kv_cache_dtype auto, then the given one) and
reports, per prompt, how many leading tokens agree, and the fraction of all tokens that agree
position by position.
"""

from __future__ import annotations

import argparse
import random

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a process and a thread.",
    "def quicksort(items):",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "What does the `yield` keyword do in Python?",
    "Implement binary search in C.",
    "Summarize the rules of chess in a few sentences.",
    "class LRUCache:\n    def __init__(self, capacity: int):",
]


def agreement(
    model: str,
    kv_cache_dtype: str,
    max_tokens: int,
    long_prompt_tokens: int,
    calculate_kv_scales: bool = False,
):
    """[(leading tokens that agree, tokens compared)] per prompt, for the chat prompts and one
    long random-token prompt of `long_prompt_tokens` tokens (0: none)."""
    from pagedlm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rng = random.Random(0)
    prompts: list = list(PROMPTS)
    max_len = 2048
    if long_prompt_tokens:
        prompts.append(
            {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(long_prompt_tokens)]}
        )
        max_len = max(max_len, long_prompt_tokens + max_tokens)
    runs = []
    for dtype in ("auto", kv_cache_dtype):
        calc = calculate_kv_scales and dtype != "auto"
        llm = LLM(model, kv_cache_dtype=dtype, max_model_len=max_len, calculate_kv_scales=calc)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
        del llm
    result = []
    for a, b in zip(*runs, strict=True):
        lead = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same = sum(x == y for x, y in zip(a, b, strict=True))
        result.append((lead, same, len(a)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--calculate-kv-scales", action="store_true")
    args = parser.parse_args()
    rows = agreement(
        args.model,
        args.kv_cache_dtype,
        args.max_tokens,
        args.long_prompt_tokens,
        args.calculate_kv_scales,
    )
    for i, (lead, same, n) in enumerate(rows):
        print(f"prompt {i}: first {lead}/{n} tokens identical, {same}/{n} positions agree")
    total = sum(n for *_, n in rows)
    print(
        f"{args.kv_cache_dtype} vs auto: {sum(s for _, s, _ in rows) / total:.3f} of positions "
        f"agree, {sum(lead for lead, _, _ in rows) / total:.3f} before the first divergence"
    )


if __name__ == "__main__":
    main()
