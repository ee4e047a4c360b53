// Shared by the packed-GGUF kernels (gguf_matmul.c: GEMV and dequantization, gguf_gemm.c:
// the batched integer GEMM): the weight descriptor, row quantization, tile unpacking.
// The layout (16-row tiles in VNNI order) is documented in
// pagedlm/kernels/gguf_pack.py and at the top of gguf_matmul.c.
#pragma once
#include <stdlib.h>

#include "common.h"

#if defined(PAGEDLM_AVX512) && defined(__AVX512VNNI__)
#define PAGEDLM_VNNI 1
#endif

#define TILE 16  // rows per tile

// How scales and mins are stored (gguf_pack.py's table): fp32, fp16, or 8-bit sub-scales
// (int8 for Q6_K, uint8 for Q4_K/Q5_K, whose mins are uint8 too) times the 256-value
// super-block's fp32 d (dmin for mins), multiplied in fp32 as ggml does.
enum { SCALES_F32 = 0, SCALES_F16 = 1, SCALES_I8_SUPER = 2, SCALES_U8_SUPER = 3 };

typedef struct {
  const uint8_t* qs;     // [T][K / 4][64] bytes (8 bits), or [T][K / 8][64] nibble pairs
  const uint8_t* qh;     // [T][K / 8][16 * (bits - 4)] bit masks (5 and 6 bits), else NULL
  const void* scales;    // [T][K / G][16], stored as `kind` says
  const void* mins;      // [T][K / G][16] like scales, or NULL
  const float* sup;      // [T][K / 256][16] d of the K-quants, else NULL
  const float* msup;     // [T][K / 256][16] dmin of the K-quants with mins, else NULL
  int64_t N, K;          // rows (T = ceil(N / 16) tiles), columns
  int bits, group, offset;
  int kind;              // SCALES_*
} QWeight;

// IEEE half -> float, exactly (subnormals, infinities and NaNs included).
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 31, man = h & 1023, bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: normalize the mantissa
    exp = 127 - 15 + 1;
    while ((man & 1024) == 0) {
      man <<= 1;
      exp--;
    }
    bits = sign | (exp << 23) | ((man & 1023) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Scale (mins = 0) or min (mins = 1) of row 16 t + r for sub-block g, as fp32.
static inline float scale_of(const QWeight* w, int mins, int64_t t, int64_t g, int r) {
  const void* v = mins ? w->mins : w->scales;
  const int64_t at = (t * (w->K / w->group) + g) * TILE + r;
  const int64_t sat = (t * (w->K / 256) + g * w->group / 256) * TILE + r;
  switch (w->kind) {
    case SCALES_F16: return half_to_float(((const uint16_t*)v)[at]);
    case SCALES_I8_SUPER: return w->sup[sat] * (float)((const int8_t*)v)[at];
    case SCALES_U8_SUPER: return (mins ? w->msup : w->sup)[sat] * (float)((const uint8_t*)v)[at];
    default: return ((const float*)v)[at];
  }
}

static inline int valid_scales(const QWeight* w) {
  const int super = w->kind == SCALES_I8_SUPER || w->kind == SCALES_U8_SUPER;
  if (w->kind < SCALES_F32 || w->kind > SCALES_U8_SUPER) return 0;
  if (!super) return 1;
  if (w->K % 256 || w->sup == NULL) return 0;
  return w->mins == NULL || (w->kind == SCALES_U8_SUPER && w->msup != NULL);
}

static inline int64_t num_tiles(const QWeight* w) { return (w->N + TILE - 1) / TILE; }

// The layouts with a fast tile-dots kernel (the GGUF types, and pack_q8's fp32 per-channel
// scales for the int8 linear methods), as X(name, bits, group, has mins, scale kind); every
// ISA instantiates its kernels from this list and finds them by `layout_key`.
#define PACKED_LAYOUTS(X)             \
  X(q8_0, 8, 32, 0, SCALES_F16)       \
  X(q8_f32, 8, 32, 0, SCALES_F32)     \
  X(q4_0, 4, 32, 0, SCALES_F16)       \
  X(q5_0, 5, 32, 0, SCALES_F16)       \
  X(q4_1, 4, 32, 1, SCALES_F16)       \
  X(q5_1, 5, 32, 1, SCALES_F16)       \
  X(q4_k, 4, 32, 1, SCALES_U8_SUPER)  \
  X(q5_k, 5, 32, 1, SCALES_U8_SUPER)  \
  X(q6_k, 6, 16, 0, SCALES_I8_SUPER)

#define LAYOUT_KEY(BITS, G, MINS, KIND) ((BITS) * 10000 + (G) * 100 + (MINS) * 10 + (KIND))

static inline int layout_key(const QWeight* w) {
  return LAYOUT_KEY(w->bits, w->group, w->mins != NULL, w->kind);
}

static inline int valid(const QWeight* w) {
  const int bits_ok = w->bits == 4 || w->bits == 5 || w->bits == 6 || w->bits == 8;
  return bits_ok && (w->group == 16 || w->group == 32) && w->N > 0 && w->K > 0 &&
         w->K % 64 == 0 && valid_scales(w);
}

// q[r][k] (16 rows x K unsigned bytes, row-major) of tile t; padding rows come out as zeros.
static inline void unpack_tile_portable(const QWeight* w, int64_t t, uint8_t* restrict q) {
  const int64_t K = w->K;
  if (w->bits == 8) {
    const uint8_t* v = w->qs + t * (K / 4) * 64;
    for (int64_t j = 0; j < K / 4; j++)
      for (int b = 0; b < 64; b++) q[(b / 4) * K + 4 * j + b % 4] = v[64 * j + b];
    return;
  }
  const int extra = w->bits - 4;
  for (int64_t s = 0; s < K / 8; s++) {
    const uint8_t* v = w->qs + (t * (K / 8) + s) * 64;
    const uint8_t* h = extra > 0 ? w->qh + (t * (K / 8) + s) * 16 * extra : NULL;
    for (int b = 0; b < 64; b++) {
      const int r = b / 4, i = b % 4;
      uint8_t lo = v[b] & 15, hi = v[b] >> 4;
      for (int p = 0; p < extra; p++) {
        lo |= ((h[16 * p + b / 8] >> (b % 8)) & 1) << (4 + p);
        hi |= ((h[16 * p + 8 + b / 8] >> (b % 8)) & 1) << (4 + p);
      }
      q[r * K + 8 * s + i] = lo;
      q[r * K + 8 * s + 4 + i] = hi;
    }
  }
}

#ifdef PAGEDLM_AVX512
// max |x[at .. at + QB)| (bf16 or fp32; QB a multiple of 16): an activation block's scale * 127.
static inline float block_amax(const void* x, int64_t at, int64_t QB, int bf16) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < QB; i += 16)
    mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x, at + i, bf16)));
  return _mm512_reduce_max_ps(mx);
}
#endif

// x row (bf16 or fp32) -> int8 per QB-value block (QB = 32, or 256 for the GEMM's K-quants);
// d[b] = amax / 127, q = x * (127 / amax) rounded half to even (the AVX-512 path's conversion
// uses the default rounding mode, the same); sums16 (NULL to skip): each 16 quants' sum.
static inline void quantize_row(const void* x, int64_t m, int64_t K, int bf16, int64_t QB,
                                int8_t* restrict q, float* restrict d, int32_t* restrict sums16,
                                float* restrict buf) {
#ifdef PAGEDLM_AVX512
  (void)buf;
  for (int64_t b = 0; b < K / QB; b++) {
    const int64_t at = m * K + QB * b;
    const float amax = block_amax(x, at, QB, bf16);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    d[b] = amax / 127.f;
    for (int64_t i = 0; i < QB; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, at + i, bf16), inv));
      _mm_storeu_si128((__m128i*)(q + QB * b + i), _mm512_cvtsepi32_epi8(v));
      // |x * inv| <= 127: the saturating narrowing above changes nothing
      if (sums16 != NULL) sums16[(QB * b + i) / 16] = _mm512_reduce_add_epi32(v);
    }
  }
#else
  load_row(x, m * K, K, bf16, buf);
  for (int64_t b = 0; b < K / QB; b++) {
    const float* v = buf + QB * b;
    float amax = 0.f;
    for (int64_t i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    for (int64_t i = 0; i < QB; i++) q[QB * b + i] = (int8_t)nearbyintf(v[i] * inv);
  }
  for (int64_t s = 0; sums16 != NULL && s < K / 16; s++) {
    int32_t total = 0;
    for (int i = 0; i < 16; i++) total += q[16 * s + i];
    sums16[s] = total;
  }
#endif
}

// Floats of scratch a row's quantization needs: the row, its block scales, its 16-quant sums.
static inline int64_t act_scratch(int64_t K) { return K + K / 32 + K / 16; }

// Sum of the quants of weight sub-block g (G = 16 or 32 values), from quantize_row's sums16.
static inline int32_t sub_block_sum(const int32_t* sums16, int64_t g, int64_t G) {
  return G == 16 ? sums16[g] : sums16[2 * g] + sums16[2 * g + 1];
}

#ifdef PAGEDLM_VNNI
// Scales (mins = 0) or mins of the 16 rows of tile t for sub-block g (KIND a compile-time
// constant at every call site).
static inline __attribute__((always_inline)) __m512 load_scales16(const QWeight* w, int mins,
                                                                  int64_t t, int64_t g,
                                                                  const int KIND) {
  const void* v = mins ? w->mins : w->scales;
  const int64_t at = (t * (w->K / w->group) + g) * TILE;
  if (KIND == SCALES_F16)
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)v + at)));
  if (KIND == SCALES_F32) return _mm512_loadu_ps((const float*)v + at);
  const __m128i bytes = _mm_loadu_si128((const __m128i*)((const uint8_t*)v + at));
  const __m512i sub =
      KIND == SCALES_I8_SUPER ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  const float* sup = mins ? w->msup : w->sup;
  const __m512 d = _mm512_loadu_ps(sup + (t * (w->K / 256) + g * w->group / 256) * TILE);
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(sub));
}

// The VNNI vectors of k-quads 2s and 2s + 1 of tile t (BITS a compile-time constant at every
// call site): 16 rows x 4 unsigned bytes each.
static inline __attribute__((always_inline)) void kquad_pair(const QWeight* w, int64_t t,
                                                             int64_t s, const int BITS,
                                                             __m512i* lo, __m512i* hi) {
  const int64_t K = w->K;
  if (BITS == 8) {
    const uint8_t* v = w->qs + (t * (K / 4) + 2 * s) * 64;
    *lo = _mm512_loadu_si512(v);
    *hi = _mm512_loadu_si512(v + 64);
    return;
  }
  const __m512i v = _mm512_loadu_si512(w->qs + (t * (K / 8) + s) * 64);
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512i l = _mm512_and_si512(v, low4), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if (BITS > 4) {
    const uint64_t* m = (const uint64_t*)(w->qh + (t * (K / 8) + s) * 16 * (BITS - 4));
    for (int p = 0; p < BITS - 4; p++) {  // bit 4 + p is still clear: a masked add sets it
      const __m512i bit = _mm512_set1_epi8((char)(1 << (4 + p)));
      l = _mm512_mask_add_epi8(l, _cvtu64_mask64(m[2 * p]), l, bit);
      h = _mm512_mask_add_epi8(h, _cvtu64_mask64(m[2 * p + 1]), h, bit);
    }
  }
  *lo = l;
  *hi = h;
}
#endif
