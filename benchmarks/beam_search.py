"""Cost of LLM.beam_search against one greedy decode of the same length (default model).

    PAGEDLM_CACHE_DIR=... .venv/bin/python benchmarks/beam_search.py --width 4 --tokens 32

Beam search runs one generate step per token over every live beam; beams reuse their prompt's
full KV blocks through the prefix cache, so each step recomputes only the last partial block of
each beam. Prints the median of --rounds timings of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedlm import LLM, SamplingParams
from pagedlm.sampling_params import BeamSearchParams

PROMPT = (
    "Write a Python function that parses a CSV file with a header row and returns a list of "
    "dictionaries, one per row, converting numeric fields to int or float where possible. "
    "Explain each step briefly."
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()
    llm = LLM(args.model, enable_prefix_caching=not args.no_prefix_caching)
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode(PROMPT)}
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    beam = BeamSearchParams(beam_width=args.width, max_tokens=args.tokens, ignore_eos=True)

    def timed(fn) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process): CPU time is steadier on a shared VM."""
        llm.reset_prefix_cache()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    def run_greedy() -> None:
        llm.generate(prompt, greedy, use_tqdm=False)

    def run_beam() -> None:
        llm.beam_search([prompt], beam)

    timed(run_greedy)  # warm-up (kernel builds, page faults)
    greedy_t, beam_t = [], []
    for _ in range(args.rounds):  # interleaved, since this machine's speed drifts
        greedy_t.append(timed(run_greedy))
        beam_t.append(timed(run_beam))
    print(
        f"prompt {len(prompt['prompt_token_ids'])} tokens, {args.tokens} new tokens, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}:"
    )
    for i, kind in enumerate(("wall", "cpu")):
        g = statistics.median(t[i] for t in greedy_t)
        b = statistics.median(t[i] for t in beam_t)
        print(f"  {kind}: greedy {g:.3f} s, beam width {args.width} {b:.3f} s, ratio {b / g:.2f}x")


if __name__ == "__main__":
    main()
