// Shared by the packed-GGUF kernels (gguf_matmul.c: GEMV and dequantization, gguf_gemm.c:
// the batched integer GEMM): the weight descriptor, activation quantization, chunk unpacking.
// The layout is documented at the top of gguf_matmul.c.
#pragma once
#include <stdlib.h>

#include "common.h"

#if defined(PAGEDLM_AVX512) && defined(__AVX512VNNI__)
#define PAGEDLM_VNNI 1
#endif

typedef struct {
  const uint8_t* qs;     // [N][K / 64][32] nibble planes, or [N][K / 64][64] bytes (8 bits)
  const uint8_t* qh;     // [N][K / 64][8 * (bits - 4)] bit planes (5 and 6 bits), else NULL
  const float* scales;   // [N][K / G]
  const float* mins;     // [N][K / G] or NULL
  int64_t N, K;
  int bits, group, offset;
} QWeight;

static inline int64_t qs_stride(const QWeight* w) { return w->bits == 8 ? 64 : 32; }

static inline int64_t qh_stride(const QWeight* w) {
  return w->bits == 5 || w->bits == 6 ? 8 * (w->bits - 4) : 0;
}

static inline int valid(const QWeight* w) {
  const int bits_ok = w->bits == 4 || w->bits == 5 || w->bits == 6 || w->bits == 8;
  return bits_ok && (w->group == 16 || w->group == 32) && w->N > 0 && w->K > 0 &&
         w->K % 64 == 0;
}

// x row (bf16 or fp32) -> int8 per 32-block; d[b] = amax / 127, q = x * (127 / amax) rounded
// half to even (the AVX-512 path's conversion uses the default rounding mode, the same).
static inline void quantize_row(const void* x, int64_t m, int64_t K, int bf16, int8_t* restrict q,
                                float* restrict d, float* restrict buf) {
#ifdef PAGEDLM_AVX512
  (void)buf;
  for (int64_t b = 0; b < K / 32; b++) {
    const __m512 v0 = load16(x, m * K + 32 * b, bf16), v1 = load16(x, m * K + 32 * b + 16, bf16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    d[b] = amax / 127.f;
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128((__m128i*)(q + 32 * b), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128((__m128i*)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(i1));
  }
#else
  load_row(x, m * K, K, bf16, buf);
  for (int64_t b = 0; b < K / 32; b++) {
    const float* v = buf + 32 * b;
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    for (int i = 0; i < 32; i++) q[32 * b + i] = (int8_t)nearbyintf(v[i] * inv);
  }
#endif
}

#ifdef PAGEDLM_VNNI
// Chunk c (64 values) of weight row n as 64 unsigned bytes in value order (BITS a compile-time
// constant at every call site).
static inline __attribute__((always_inline)) __m512i unpack_chunk(const QWeight* w, int64_t n,
                                                                  int64_t c, const int BITS) {
  const int64_t chunks = w->K / 64;
  if (BITS == 8) return _mm512_loadu_si512(w->qs + (n * chunks + c) * 64);
  const __m512i b =
      _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w->qs + (n * chunks + c) * 32)));
  __m512i v = _mm512_and_si512(_mm512_srlv_epi64(b, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)),
                               _mm512_set1_epi8(15));
  for (int p = 0; p < BITS - 4; p++) {
    uint64_t bits;
    memcpy(&bits, w->qh + (n * chunks + c) * 8 * (BITS - 4) + 8 * p, 8);
    // bit 4 + p is still clear: a masked add sets it (one instruction, not mov + or)
    v = _mm512_mask_add_epi8(v, _cvtu64_mask64(bits), v, _mm512_set1_epi8((char)(1 << (4 + p))));
  }
  return v;
}
#endif
