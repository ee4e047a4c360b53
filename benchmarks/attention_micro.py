"""Per-layer attention time of the C paged kernels, by default on the default model's shapes
(14 query heads, 2 KV heads, head size 64; `--shape` for others), 16-token blocks, bf16 (or
fp32, as AVX2 machines run it), with the achieved GFLOP/s (4 * head_size flops per query-key
pair inside the causal mask). Short; machine noise applies.

    python benchmarks/attention_micro.py [--contexts 4096 16384] [--chunk 512] [--dtype float32]
        [--shape 12/2/128] [--decode-batch 32x320]

Rows: a fresh prompt of `context` tokens in one chunk (when it is at most 4096), a `chunk`-token
prefill chunk after `context` cached tokens, and one decode step at `context`. `--decode-batch
BxC` adds a decode step of B sequences at C tokens each as a model's step sees it: every
layer's cache cold (LAYERS caches in turn, blocks in random order), per layer, with the cache
read in GB/s.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.kernels.cpu_attention import paged_decode_attention, paged_prefill_attention
from pagedlm.utils import huge_page_zeros

BLOCK = 16
LAYERS = 28  # caches cycled by --decode-batch (the 1.5B's layer count)


def paged_cache(
    tokens: int, kv_heads: int, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """K, V and a block table in random order; K and V in transparent huge pages past their
    first 2 MiB, as the engine allocates a KV cache (`utils.huge_page_zeros`)."""
    blocks = (tokens + BLOCK - 1) // BLOCK
    table = torch.randperm(blocks).view(1, blocks)
    kv = huge_page_zeros((2, blocks, BLOCK, kv_heads, head_size), dtype, parts=2)
    kv.copy_(torch.randn(kv.shape))
    return kv[0], kv[1], table


def time_ms(fn, iters: int) -> float:
    """Fastest of `iters` calls: other tenants of the machine only ever add time."""
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def decode_batch_ms(
    lib, spec: str, heads: int, kv_heads: int, head_size: int, dtype: torch.dtype, iters: int
) -> tuple[float, float]:
    """(ms per layer, cache GB/s) of a decode step of B sequences at C tokens (`spec` BxC),
    every layer's cache cold."""
    try:
        b, c = (int(x) for x in spec.split("x"))
    except ValueError:
        raise SystemExit(f"--decode-batch: BxC (e.g. 32x320), not {spec!r}") from None
    if b < 1 or c < BLOCK or c % BLOCK:
        raise SystemExit(f"--decode-batch: B >= 1 and C a positive multiple of {BLOCK}")
    caches = [paged_cache(b * c, kv_heads, head_size, dtype) for _ in range(LAYERS)]
    q = torch.randn(b, heads, head_size).to(dtype)
    lens = torch.full((b,), c)

    def step() -> None:
        for k, v, table in caches:
            paged_decode_attention(lib, q, k, v, table.view(b, -1), lens, head_size**-0.5, None)

    ms = time_ms(step, iters) / LAYERS
    cache_bytes = 2 * b * c * kv_heads * head_size * dtype.itemsize
    return ms, cache_bytes / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--shape",
        default="14/2/64",
        help="query heads/KV heads/head size (default: the 0.5B's; 1.5B: 12/2/128, 3B: 16/2/128)",
    )
    parser.add_argument("--decode-batch", metavar="BxC", help="e.g. 32x320 (`random`'s steps)")
    args = parser.parse_args()
    shape = heads, kv_heads, head_size = tuple(int(x) for x in args.shape.split("/"))
    lib = cpu_kernels()
    if lib is None:
        raise SystemExit("no C compiler: the C kernels are not built")
    dtype, scale = getattr(torch, args.dtype), head_size**-0.5
    print(f"{'case':<30}{'ms':>10}{'GFLOP/s':>10}")
    for context in args.contexts:
        cases = [("fresh", context, context)] if context <= 4096 else []
        cases.append(("chunk", args.chunk, context + args.chunk))
        for name, rows, seq_len in cases:
            k, v, table = paged_cache(seq_len, kv_heads, head_size, dtype)
            q = torch.randn(rows, heads, head_size).to(dtype)
            qsl = torch.tensor([0, rows])
            lens = torch.tensor([seq_len])
            call = partial(paged_prefill_attention, lib, q, k, v, table, qsl, lens, scale, None)
            ms = time_ms(call, args.iters)
            pairs = rows * (seq_len - rows) + rows * (rows + 1) / 2
            gflops = 4 * head_size * heads * pairs / ms / 1e6
            print(f"{f'{name} {rows} rows at {seq_len}':<30}{ms:>10.2f}{gflops:>10.0f}")
        k, v, table = paged_cache(context, kv_heads, head_size, dtype)
        q = torch.randn(1, heads, head_size).to(dtype)
        lens = torch.tensor([context])
        ms = time_ms(partial(paged_decode_attention, lib, q, k, v, table, lens, scale, None), 20)
        gflops = 4 * head_size * heads * context / ms / 1e6
        print(f"{f'decode at {context}':<30}{ms:>10.2f}{gflops:>10.0f}")
    if args.decode_batch:
        ms, gbs = decode_batch_ms(lib, args.decode_batch, *shape, dtype, args.iters)
        print(
            f"decode {args.decode_batch}, {LAYERS} cold layers: {ms:.3f} ms a layer, {gbs:.1f} GB/s"
        )


if __name__ == "__main__":
    main()
