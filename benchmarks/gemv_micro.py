"""Per-layer decode GEMV time: pagedlm's small-batch linear (dense and blocked bf16) and the
packed-GGUF integer kernel (the default model's type per layer) against oneDNN (prepacked
weight and plain F.linear) on the default model's shapes. Short; machine noise applies.

    python benchmarks/gemv_micro.py [--rows 1 16] [--iters 50]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedlm.kernels import cpu as k
from pagedlm.kernels.gguf_pack import pack_gguf
from pagedlm.layers.quantization.gguf import gguf_linear

# The default model's (Qwen2.5-Coder-0.5B Q4_K_M) GGUF type per layer: K-quants only where
# K is a multiple of 256 (ffn_down: Q6_K or Q4_K), Q5_0 elsewhere, Q8_0 LM head.
GGUF_TYPES = {
    "o_proj": "Q5_0",
    "gate_up": "Q5_0",
    "up": "Q5_0",
    "down": "Q6_K",
    "qkv": "Q5_0",
    "lm_head": "Q8_0",
}
_FP16_FIELDS = {"Q5_0": [0], "Q8_0": [0], "Q6_K": [208], "Q4_K": [0, 2]}
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
    """Median microseconds per call (the machine is shared: preemptions hit single calls).
    With one thread (OMP_NUM_THREADS=1) it is CPU time, which other tenants do not inflate."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    times = []
    for _ in range(iters * 3):
        t = clock()
        fn()
        times.append(clock() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def _random_gguf(type_name: str, n: int, kk: int, seed: int):
    """Random blocks of a GGUF type (scale fields ~0.01), packed for the integer kernels."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    t = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * kk // block, size), dtype=np.uint8)
    for off in _FP16_FIELDS[type_name]:
        d = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return pack_gguf(raw, t, (n, kk))


def bench_shape(name: str, n: int, kk: int, rows: list[int], iters: int) -> None:
    # Enough copies to exceed the last-level cache: decode reads every weight from DRAM.
    copies = max(1, (256 << 20) // (n * kk * 2))
    ws = [(torch.randn(n, kk) * 0.02).bfloat16() for _ in range(copies)]
    packs = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
    blocks = [k.block_small_batch_weight(w) for w in ws]
    packed = [_random_gguf(GGUF_TYPES[name], n, kk, seed) for seed in range(len(ws))]
    iters = max(3, iters * 896 * 896 // (n * kk))
    isa = k.small_batch_linear_isa()  # asked for: the dense loop at every row count
    it = Cycle(len(ws))
    for m in rows:
        x = torch.randn(m, kk).bfloat16()

        def onednn(x=x):
            return torch.ops.mkldnn._linear_pointwise(x, packs[it()], None, "none", [], "")

        t1 = timeit(onednn, iters)
        t2 = timeit(lambda x=x: F.linear(x, ws[it()]), iters)
        t3 = timeit(lambda x=x: k.small_batch_linear(x, ws[it()], None, isa=isa), iters)
        t4 = timeit(lambda x=x: k.small_batch_linear(x, blocks[it()], None), iters)
        t5 = timeit(lambda x=x: gguf_linear(x, packed[it()]), iters)
        gbs = n * kk * 2 / t4 / 1e3
        print(
            f"{name:8} {m:>3} {t1:14.1f} {t2:9.1f} {t3:9.1f} {t4:9.1f} {t5:9.1f} "
            f"{GGUF_TYPES[name]}  (blocked: {gbs:.1f} GB/s)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = ap.parse_args()
    print(f"threads={torch.get_num_threads()} isa={k.small_batch_linear_isa()}")
    head = ("layer", "M", "onednn_packed", "F.linear", "dense", "blocked", "gguf")
    print("{:8} {:>3} {:>14} {:>9} {:>9} {:>9} {:>9}  (median us per call)".format(*head))
    for name in args.shapes:
        bench_shape(name, *SHAPES[name], args.rows, args.iters)


if __name__ == "__main__":
    main()
