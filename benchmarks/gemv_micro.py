"""Per-layer decode GEMV time: pagedlm's small-batch linear against oneDNN (prepacked weight and
plain F.linear) on the default model's shapes. Short (a few seconds); machine noise applies.

    python benchmarks/gemv_micro.py [--rows 1 16] [--iters 50]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedlm.kernels import cpu as k

SHAPES = {
    "o_proj": (896, 896),
    "gate_up": (9728, 896),
    "up": (4864, 896),
    "down": (896, 4864),
    "qkv": (1152, 896),
    "lm_head": (151936, 896),
}


class Cycle:
    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __call__(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


def timeit(fn, iters: int) -> float:
    """Median microseconds per call (the machine is shared: preemptions hit single calls)."""
    fn()
    times = []
    for _ in range(iters * 3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def bench_shape(name: str, n: int, kk: int, rows: list[int], iters: int) -> None:
    # Enough copies to exceed the last-level cache: decode reads every weight from DRAM.
    copies = max(1, (256 << 20) // (n * kk * 2))
    ws = [(torch.randn(n, kk) * 0.02).bfloat16() for _ in range(copies)]
    packs = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
    blocks = [k.block_small_batch_weight(w) for w in ws]
    iters = max(3, iters * 896 * 896 // (n * kk))
    it = Cycle(len(ws))
    for m in rows:
        x = torch.randn(m, kk).bfloat16()

        def onednn(x=x):
            return torch.ops.mkldnn._linear_pointwise(x, packs[it()], None, "none", [], "")

        t1 = timeit(onednn, iters)
        t2 = timeit(lambda x=x: F.linear(x, ws[it()]), iters)
        t3 = timeit(lambda x=x: k.small_batch_linear(x, ws[it()], None), iters)
        t4 = timeit(lambda x=x: k.small_batch_linear(x, blocks[it()], None), iters)
        gbs = n * kk * 2 / t4 / 1e3
        print(f"{name:8} {m:>3} {t1:14.1f} {t2:9.1f} {t3:9.1f} {t4:9.1f}  ({gbs:.1f} GB/s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = ap.parse_args()
    print(f"threads={torch.get_num_threads()} isa={k.small_batch_linear_isa()}")
    head = ("layer", "M", "onednn_packed", "F.linear", "dense", "blocked")
    print("{:8} {:>3} {:>14} {:>9} {:>9} {:>9}  (median us per call)".format(*head))
    for name in args.shapes:
        bench_shape(name, *SHAPES[name], args.rows, args.iters)


if __name__ == "__main__":
    main()
