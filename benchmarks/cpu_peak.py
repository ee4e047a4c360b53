"""The peaks the GEMMs are measured against: how many `vdpbf16ps` (bf16), `vpdpbusd` (int8,
VNNI) and `vfmadd` (fp32) of 512 bits all cores retire a nanosecond, in a loop of 16
independent accumulators, and how fast they stream plain loads from memory. AVX-512 CPUs
only; gcc with OpenMP. Short; machine noise applies (the best of 3 runs is printed).

    python benchmarks/cpu_peak.py

The accumulators start from different values: 16 chains from the same start are one chain to
gcc, which then times the instruction's latency instead of its throughput.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define ITERS 20000000L
static float seed[32];

#define LOOP(NAME, TYPE, OP)                                                        \
  __attribute__((noinline)) static float NAME(void) {                              \
    __m512 a[16];                                                                   \
    for (int i = 0; i < 16; i++) a[i] = _mm512_set1_ps(seed[i]);                    \
    __m512 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5];        \
    __m512 a6 = a[6], a7 = a[7], a8 = a[8], a9 = a[9], a10 = a[10], a11 = a[11];    \
    __m512 a12 = a[12], a13 = a[13], a14 = a[14], a15 = a[15];                      \
    const TYPE w = (TYPE)_mm512_set1_ps(seed[16]), x = (TYPE)_mm512_set1_ps(seed[17]); \
    for (long it = 0; it < ITERS; it++) {                                           \
      OP(a0) OP(a1) OP(a2) OP(a3) OP(a4) OP(a5) OP(a6) OP(a7)                       \
      OP(a8) OP(a9) OP(a10) OP(a11) OP(a12) OP(a13) OP(a14) OP(a15)                 \
    }                                                                               \
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), \
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))); \
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a8, a9),         \
                                                     _mm512_add_ps(a10, a11)),       \
                                       _mm512_add_ps(_mm512_add_ps(a12, a13),        \
                                                     _mm512_add_ps(a14, a15))));     \
    return _mm512_reduce_add_ps(s);                                                 \
  }

#define BF16(a) a = _mm512_dpbf16_ps(a, w, x);
#define VNNI(a) a = (__m512)_mm512_dpbusd_epi32((__m512i)a, w, x);
#define FMA(a) a = _mm512_fmadd_ps(a, w, x);
LOOP(loop_bf16, __m512bh, BF16)
LOOP(loop_vnni, __m512i, VNNI)
LOOP(loop_fma, __m512, FMA)

static double timed(float (*fn)(void)) {
  float sink = 0.f;
  const double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
  sink += fn();
  const double dt = omp_get_wtime() - t0;
  if (sink == 12345.f) printf(" ");
  return 16.0 * ITERS * omp_get_max_threads() / dt / 1e9;  // instructions a ns
}

int main(void) {
  for (int i = 0; i < 32; i++) seed[i] = 1e-3f * (float)(i + 1);
  const char* names[3] = {"vdpbf16ps", "vpdpbusd", "vfmadd ps"};
  float (*fns[3])(void) = {loop_bf16, loop_vnni, loop_fma};
  const double ops[3] = {64, 128, 32};  // 2 x multiply-adds per instruction
  for (int f = 0; f < 3; f++) {
    double best = 0;
    for (int r = 0; r < 3; r++) {
      const double v = timed(fns[f]);
      best = v > best ? v : best;
    }
    printf("%-12s %6.2f a ns  %6.3f T(FL)OP/s\n", names[f], best, best * ops[f] / 1e3);
  }
  const int64_t n = (int64_t)1 << 27;  // 512 MiB of floats, streamed
  float* buf = aligned_alloc(64, n * sizeof(float));
#pragma omp parallel for
  for (int64_t i = 0; i < n; i++) buf[i] = 1.f;
  double best = 0;
  for (int r = 0; r < 3; r++) {
    float sink = 0.f;
    const double t0 = omp_get_wtime();
#pragma omp parallel for reduction(+ : sink)
    for (int64_t i = 0; i < n; i += 64) {
      __m512 s = _mm512_loadu_ps(buf + i);
      for (int j = 16; j < 64; j += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(buf + i + j));
      sink += _mm512_reduce_add_ps(s);
    }
    const double gbs = n * sizeof(float) / (omp_get_wtime() - t0) / 1e9;
    best = gbs > best ? gbs : best;
    if (sink == 1.f) printf(" ");
  }
  printf("%-12s %6.1f GB/s\n", "loads", best);
  free(buf);
  return 0;
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(SOURCE)
        cmd = ["gcc", "-O3", "-march=native", "-fopenmp", str(src), "-o", str(exe)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"needs gcc and a CPU with AVX-512 BF16 and VNNI:\n{built.stderr[-2000:]}")
        threads = os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count())
        print(f"{threads} threads, 16 independent accumulators")
        subprocess.run([str(exe)], check=True, env={**os.environ, "OMP_NUM_THREADS": threads})


if __name__ == "__main__":
    main()
