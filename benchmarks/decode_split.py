"""Where a decode step goes: each C call of the decode plan (`LlamaDecodePlan.calls`) timed
over the steps of a batch, grouped by the layer it computes (`mlp.down_proj`, ...) or the
kernel it runs, plus the LM head (`compute_logits`) and the whole `LLMEngine.step`.

A batch of `--batch` random prompts of `--input-len` tokens is prefilled and then decoded for
`--steps` steps (`ignore_eos`); only the decode steps are timed. Each linear's rate counts
2 x rows x N x K per layer, to set against the CPU's peak (`benchmarks/cpu_peak.py`). Runs
with tcmalloc preloaded where the system has it, as the throughput benchmarks run pagedlm.

    python benchmarks/decode_split.py --model DIR [--quantization int8] [--batch 32] \\
        [--input-len 256] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import find_tcmalloc, with_preloaded  # noqa: E402


def instrument(seconds: Counter, operations: Counter) -> None:
    """Time every call of each decode plan (labelled once, on its first run) and the LM head
    into `seconds`; `operations` counts each linear's multiply-adds x 2 over the runs."""
    import pagedlm.models.llama_decode_plan as plan_module
    from pagedlm.models.llama import LlamaForCausalLM

    plan_class = plan_module.LlamaDecodePlan

    def labelled(method, label_of):
        def build(self, lib, module, *args):
            start = len(self.calls)
            method(self, lib, module, *args)
            label = label_of(self, module)
            self.labels = getattr(self, "labels", {})
            for i in range(start, len(self.calls)):
                self.labels[i] = label
            self.operations = getattr(self, "operations", Counter())
            self.operations[label] += 2 * self.rows * module.output_size * module.input_size

        return build

    def name_of(self, module) -> str:
        names = {id(m): name for name, m in self.model.named_modules()}
        return ".".join(names[id(module)].split(".")[-2:])

    plan_class._linear = labelled(plan_class._linear, name_of)
    plan_class._gate_up_act = labelled(
        plan_class._gate_up_act, lambda self, m: name_of(self, m) + " (+ silu_and_mul)"
    )
    run = plan_class.run

    def timed_run(self, *args, **kwargs):
        if not getattr(self, "timed", False):
            labels = getattr(self, "labels", {})
            self.calls = [
                (timer(fn, labels.get(i, fn.__name__)), call_args, ok)
                for i, (fn, call_args, ok) in enumerate(self.calls)
            ]
            self.timed = True
        operations.update(getattr(self, "operations", {}))
        return run(self, *args, **kwargs)

    def timer(fn, label):
        def call(*args):
            start = time.perf_counter()
            result = fn(*args)
            seconds[label] += time.perf_counter() - start
            return result

        call.__name__ = fn.__name__
        return call

    plan_class.run = timed_run
    compute_logits = LlamaForCausalLM.compute_logits

    def timed_logits(self, *args, **kwargs):
        start = time.perf_counter()
        result = compute_logits(self, *args, **kwargs)
        seconds["LM head (compute_logits)"] += time.perf_counter() - start
        return result

    LlamaForCausalLM.compute_logits = timed_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--quantization", default=None, help='e.g. "int8"')
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    for name in ("batch", "input_len", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    tcmalloc = find_tcmalloc()
    if tcmalloc and tcmalloc not in os.environ.get("LD_PRELOAD", ""):
        os.execve(sys.executable, [sys.executable, *sys.argv], with_preloaded(os.environ, tcmalloc))

    from pagedlm import LLM, SamplingParams

    seconds: Counter = Counter()
    operations: Counter = Counter()
    instrument(seconds, operations)
    llm = LLM(
        model=args.model,
        quantization=args.quantization,
        max_model_len=args.input_len + args.steps + 8,
        enable_prefix_caching=False,
        seed=0,
    )
    engine = llm.llm_engine
    rng = random.Random(0)
    vocab = min(engine.get_tokenizer().vocab_size, 30000)
    params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, temperature=0)
    for i in range(args.batch):
        prompt = [rng.randrange(100, vocab) for _ in range(args.input_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    generated: dict[str, int] = {}
    while len(generated) < args.batch or min(generated.values()) < 2:  # prefill, one decode
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)
    seconds.clear()
    operations.clear()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    step_ms = (time.perf_counter() - start) / steps * 1e3
    if set(seconds) <= {"LM head (compute_logits)"}:
        sys.exit(
            "decode_split: no decode plan ran (a Llama-family model on the C kernels, "
            "PAGEDLM_DISABLE_DECODE_PLAN unset, up to 64 rows)"
        )
    print(f"{args.model}, {args.batch} rows, {steps} decode steps: {step_ms:.1f} ms a step")
    for label, total in seconds.most_common():
        ms = total / steps * 1e3
        rate = f"  {operations[label] / total / 1e12:5.2f} T(FL)OP/s" if label in operations else ""
        print(f"  {label:36s} {ms:8.2f} ms  {ms / step_ms:6.1%}{rate}")
    rest = step_ms - sum(seconds.values()) / steps * 1e3
    print(f"  {'outside the plan and the head':36s} {rest:8.2f} ms  {rest / step_ms:6.1%}")


if __name__ == "__main__":
    main()
