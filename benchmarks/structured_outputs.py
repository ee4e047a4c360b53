"""Per-decode-step cost of structured outputs (grammar bitmask fill, logits masking, matcher
advance) on the default model.

    PAGEDLM_CACHE_DIR=... .venv/bin/python benchmarks/structured_outputs.py --batch 8 --tokens 48

Runs the same batch twice, interleaved --rounds times: unconstrained (ignore_eos) and every
request under a regex that cannot end before --tokens tokens; both run exactly --tokens decode
steps. Reports the median time per step of each, and the time spent inside the three
structured-output hooks per step (measured by wrapping them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import pagedlm.core.scheduler as scheduler_module
import pagedlm.layers.sampler as sampler_module
from pagedlm import LLM, SamplingParams
from pagedlm.sampling_params import StructuredOutputsParams

TIMERS: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False)
    manager = llm.llm_engine.structured_output_manager
    manager.grammar_bitmask = timed("fill bitmask", manager.grammar_bitmask)
    sampler_module.apply_grammar_bitmask = timed(
        "apply bitmask", sampler_module.apply_grammar_bitmask
    )
    scheduler_module.advance_grammar = timed("advance matcher", scheduler_module.advance_grammar)

    prompts = [
        {"prompt_token_ids": llm.get_tokenizer().encode(f"Write a long story, part {i}:")}
        for i in range(args.batch)
    ]
    free = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    # at least 8 characters per token can never finish before --tokens tokens
    regex = f"[a-z ]{{{8 * args.tokens},{16 * args.tokens}}}"
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.tokens,
        structured_outputs=StructuredOutputsParams(regex=regex),
    )

    def run(params: SamplingParams) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
        return elapsed

    run(constrained)  # warm-up: compiles the grammar, builds kernels
    TIMERS.clear()
    free_t, so_t = [], []
    for _ in range(args.rounds):
        free_t.append(run(free))
        so_t.append(run(constrained))
    steps = args.tokens  # the prefill step samples the first token
    f = statistics.median(free_t) / steps * 1e3
    s = statistics.median(so_t) / steps * 1e3
    print(f"batch {args.batch}, {args.tokens} tokens each, vocab {manager.vocab_size}:")
    print(f"  per step: unconstrained {f:.1f} ms, all constrained {s:.1f} ms ({s - f:+.1f} ms)")
    for name, total in TIMERS.items():
        print(f"  {name}: {total / (args.rounds * steps) * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
