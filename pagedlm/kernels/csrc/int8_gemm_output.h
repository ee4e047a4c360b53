// What the per-channel int8 GEMMs (int8_gemm_amx.c, int8_gemm_vnni.c) share: their shape rules
// and where they write a pair of weight tiles' scaled sums: y rows ldy apart, or silu(gate) *
// up of a fused gate_up, by plain or non-temporal stores.
#pragma once
#include "gguf_common.h"

#ifdef PAGEDLM_AVX512
#define STREAM_BYTES (4 << 20)  // outputs this large (past the L2s) go by non-temporal stores

// Where y goes: rows ldy apart, columns scaled by ws[n] (+ bias[n]). With `stream` (outputs
// past STREAM_BYTES, rows 64-byte aligned) a pair's rows are written with non-temporal stores,
// which skip reading each line of y before overwriting it. With `up` (silu_and_mul fused:
// W's rows are [gate | up], up = N / 2) y holds silu(gate) * up, N / 2 columns: a gate pair's
// scaled sums wait in `gate` (this thread's, 32 a block row) for the up pair N / 2 columns on.
typedef struct {
  void* y;
  const float* ws;
  const void* bias;
  int64_t ldy, N, up;
  int bf16, stream;
  float* gate;
} Output;

// The shape rules both per-channel GEMMs take (their arguments: int8_gemm_amx.c): QB a
// multiple of 64 dividing K, and with silu_and_mul N a multiple of 64 and y N / 2 wide.
static inline int channel_gemm_shapes_ok(int64_t M, int64_t N, int64_t K, int64_t QB,
                                         int64_t ldy, int silu_and_mul) {
  if (M < 1 || N < 1 || QB < 64 || QB % 64 || K % QB) return 0;
  return !(silu_and_mul && N % 64) && ldy >= (silu_and_mul ? N / 2 : N);
}

// The Output of an [M, N] product (silu_and_mul: y [M, N / 2]); `gate` is each thread's own.
static inline Output make_output(void* y, const float* ws, const void* bias, int64_t ldy,
                                 int64_t M, int64_t N, int bf16, int silu_and_mul) {
  const int64_t bytes = bf16 ? 2 : 4, up = silu_and_mul ? N / 2 : 0;
  const int stream = M * (up ? up : N) * bytes >= STREAM_BYTES && (uintptr_t)y % 64 == 0 &&
                     ldy * bytes % 64 == 0;
  return (Output){y, ws, bias, ldy, N, up, bf16, stream, NULL};
}

// 16 of bias (x's dtype) from column n0, zeros past N or without one.
static inline __m512 bias16(const Output* o, int64_t n0) {
  if (o->bias == NULL || n0 >= o->N) return _mm512_setzero_ps();
  const __mmask16 lanes = lanes_below(o->N - n0);
  if (o->bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, (const uint16_t*)o->bias + n0);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(lanes, (const float*)o->bias + n0);
}

// y row m, columns n0 .. n0 + 16 NT - 1 (those below N) = lo, hi.
static inline void store_pair_row(const Output* o, int64_t m, int64_t n0, __m512 lo,
                                  __m512 hi, const int NT) {
  const int64_t at = m * o->ldy + n0;
  if (NT > 1 && o->N - n0 >= 32) {
    if (o->bf16) {
      const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_bits512(lo)),
                                           bf16_bits512(hi), 1);
      if (o->stream)
        _mm512_stream_si512((__m512i*)((uint16_t*)o->y + at), v);
      else
        _mm512_storeu_si512((uint16_t*)o->y + at, v);
    } else if (o->stream) {
      _mm512_stream_ps((float*)o->y + at, lo);
      _mm512_stream_ps((float*)o->y + at + 16, hi);
    } else {
      _mm512_storeu_ps((float*)o->y + at, lo);
      _mm512_storeu_ps((float*)o->y + at + 16, hi);
    }
    return;
  }
  for (int j = 0; j < NT && n0 + 16 * j < o->N; j++)
    store16_lanes(o->y, at + 16 * j, j ? hi : lo, o->bf16, lanes_below(o->N - n0 - 16 * j));
}

// Row m (block row i) of a pair's scaled sums lo, hi from column n0: to y, or with `up` to the
// gate stash (columns below up) or to y as silu(gate) * up, each rounded as y's dtype first
// (as the unfused y and silu_and_mul round them).
static inline void finish_pair_row(const Output* o, int64_t i, int64_t m, int64_t n0, __m512 lo,
                                   __m512 hi, const int NT) {
  if (o->up == 0) {
    store_pair_row(o, m, n0, lo, hi, NT);
    return;
  }
  if (o->bf16) lo = round512_bf16(lo), hi = round512_bf16(hi);
  float* g = o->gate + 32 * i;
  if (n0 < o->up) {
    _mm512_store_ps(g, lo);
    _mm512_store_ps(g + 16, hi);
    return;
  }
  store_pair_row(o, m, n0 - o->up, silu_mul512(_mm512_load_ps(g), lo, o->bf16),
                 silu_mul512(_mm512_load_ps(g + 16), hi, o->bf16), NT);
}

#endif
