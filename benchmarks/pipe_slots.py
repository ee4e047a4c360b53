"""Which vector operations compete with vdpbf16ps for its pipe slot on this CPU.

    .venv/bin/python benchmarks/pipe_slots.py

A kernel whose inner loop is dot products (attention's QK and P.V, the bf16 linears) pays for
any other operation only when that operation needs the same execution port. This compiles a
loop of 16 independent vdpbf16ps (enough chains to run at full rate), alone and then
interleaved with 4 operations of one kind, and prints how many dot-product slots each such
operation costs: ~1 where it shares the port, ~0 where it runs beside. Needs gcc and a CPU with
AVX-512 BF16; single-threaded. (Zen 4, 2026-12-01: float multiplies, multiply-adds and
vrcp14ps take a slot, vdivps two; adds, max, vreduceps, vscalefps, conversions, integer
operations, shuffles, loads and broadcasts are free up to 4 per 16 dot products.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> C expression of v (the previous value of this chain), c1 and c2 (constants)
OPERATIONS = {
    "fma": "_mm512_fmadd_ps(v, c1, c2)",
    "mul": "_mm512_mul_ps(v, c1)",
    "div": "_mm512_div_ps(c1, _mm512_add_ps(v, c2))",
    "rcp14": "_mm512_rcp14_ps(v)",
    "add": "_mm512_add_ps(v, c1)",
    "max": "_mm512_max_ps(v, c1)",
    "roundscale": "_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)",
    "reduce": "_mm512_reduce_ps(v, 0x09)",
    "scalef": "_mm512_scalef_ps(v, c1)",
    "cvtneps2bf16": "_mm512_castsi512_ps(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v)))",
    "cvtps2dq": "_mm512_castsi512_ps(_mm512_cvtps_epi32(v))",
    "paddd": "_mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(v), "
    "_mm512_castps_si512(c1)))",
    "pslld": "_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(v), 1))",
    "permutexvar": "_mm512_permutexvar_ps(_mm512_castps_si512(c2), v)",
    "unpacklo": "_mm512_unpacklo_ps(v, c1)",
    "add+broadcast": "_mm512_add_ps(v, _mm512_set1_ps(mp[j]))",
    "add+load": "_mm512_add_ps(v, _mm512_loadu_ps(mp + 16 * j))",
}

PROLOGUE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define ITERS 20000000L
#define NOPS 4
static float mem[64];
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
#define BENCH(NAME, EXPR)                                                                  \
  static double NAME(void) {                                                               \
    __m512 a[16], b[NOPS];                                                                 \
    for (int i = 0; i < 16; i++) a[i] = _mm512_set1_ps((float)i);                          \
    for (int j = 0; j < NOPS; j++) b[j] = _mm512_set1_ps(0.3f * j);                        \
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);                                  \
    const __m512bh y = (__m512bh)_mm512_set1_epi32(0x3f003f00);                            \
    const __m512 c1 = _mm512_set1_ps(0.5f), c2 = _mm512_set1_ps(0.25f);                    \
    const float* mp = mem; /* laundered each loop: its reads stay loads */                 \
    (void)c1, (void)c2, (void)mp;                                                          \
    const double t0 = now();                                                               \
    for (long it = 0; it < ITERS; it++) {                                                  \
      _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], x, y); \
      _Pragma("GCC unroll 4") for (int j = 0; j < NOPS; j++) {                             \
        const __m512 v = b[j];                                                             \
        b[j] = (EXPR);                                                                     \
      }                                                                                    \
      __asm__ volatile("" : "+v"(x), "+r"(mp));                                            \
    }                                                                                      \
    const double t = now() - t0;                                                           \
    float out = 0;                                                                         \
    for (int i = 0; i < 16; i++) out += _mm512_reduce_add_ps(a[i]);                        \
    for (int j = 0; j < NOPS; j++) out += _mm512_reduce_add_ps(b[j]);                      \
    mem[0] = out;                                                                          \
    return t;                                                                              \
  }
"""


def source() -> str:
    names = ["none", *OPERATIONS]
    exprs = ["v", *OPERATIONS.values()]
    benches = "\n".join(f"BENCH(b{i}, {e})" for i, e in enumerate(exprs))
    table = ", ".join(f"b{i}" for i in range(len(exprs)))
    labels = ", ".join(f'"{n}"' for n in names)
    return f"""{PROLOGUE}
{benches}
int main(void) {{
  double (*f[])(void) = {{{table}}};
  const char* names[] = {{{labels}}};
  double base = 0;
  for (int w = 0; w < {len(names)}; w++) {{
    double best = 1e9;
    for (int r = 0; r < 3; r++) {{
      const double t = f[w]();
      best = t < best ? t : best;
    }}
    if (w == 0) {{
      base = best;
      printf("16 vdpbf16ps alone: %.2f ns per loop\\n", best / ITERS * 1e9);
      continue;
    }}
    printf("%-14s %+.2f dot-product slots per operation\\n", names[w],
           (best / base - 1) * 16 / NOPS);
  }}
  return 0;
}}
"""


def main() -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        sys.exit("pipe_slots: no C compiler (gcc)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "pipe_slots.c", Path(tmp) / "pipe_slots"
        src.write_text(source())
        build = subprocess.run(
            [cc, "-O2", "-march=native", str(src), "-o", str(exe)], capture_output=True, text=True
        )
        if build.returncode != 0:
            sys.exit(
                f"pipe_slots: this CPU or compiler has no AVX-512 BF16\n{build.stderr[-2000:]}"
            )
        subprocess.run([str(exe)], check=True)


if __name__ == "__main__":
    main()
