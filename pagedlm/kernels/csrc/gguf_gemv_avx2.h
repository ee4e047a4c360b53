// The packed-weight tile dots on AVX2 (no VNNI): the twin of gguf_matmul.c's vpdpbusd
// `tile_dots`, for every layout it takes, included by gguf_matmul.c.
//
// A 64-byte k-quad vector is two 32-byte halves, rows 0-7 and rows 8-15; each half is
// computed on its own (one accumulator per activation row fits the 16 ymm registers). AVX2
// has no u8 x s8 dot product into int32: `vpmaddubsw` sums pairs of u8 x s8 products into
// int16 (saturating), `vpmaddwd` by ones widens to int32. The sums stay exact:
//
// - 4/5/6-bit q (u8, at most 63) against activation quants (|x| <= 127): a pair is at most
//   16002, so both k-quads of a nibble vector add in int16 (32004) before one widening;
// - 8-bit q is stored as q + 128: flipping the top bit gives the signed q (the offset
//   applied, so the -offset * sum correction is skipped), and the sign goes onto the
//   activations, |q| (at most 128, as u8) times sign(q) * x, pairs at most 32512.
#pragma once
#include "gguf_common.h"

#if !defined(PAGEDLM_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLM_AVX2_INT8 1

// Scales (mins = 0) or mins of rows 8 h .. 8 h + 7 of tile t for sub-block g.
static inline __attribute__((always_inline)) __m256 load_scales8(const QWeight* w, int mins,
                                                                 int64_t t, int64_t g, int h,
                                                                 const int KIND) {
  const void* v = mins ? w->mins : w->scales;
  const int64_t at = (t * (w->K / w->group) + g) * TILE + 8 * h;
  if (KIND == SCALES_F16)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)v + at)));
  if (KIND == SCALES_F32) return _mm256_loadu_ps((const float*)v + at);
  const __m128i bytes = _mm_loadl_epi64((const __m128i*)((const uint8_t*)v + at));
  const __m256i sub =
      KIND == SCALES_I8_SUPER ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  const float* sup = mins ? w->msup : w->sup;
  const __m256 d = _mm256_loadu_ps(sup + (t * (w->K / 256) + g * w->group / 256) * TILE + 8 * h);
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(sub));
}

// 32 bits of a mask -> 32 bytes, byte i = `bit` where bit i is set, else 0.
static inline __attribute__((always_inline)) __m256i mask_bytes(uint32_t m, __m256i bit) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                          2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, select), select), bit);
}

// Half h of the k-quad vectors 2s and 2s + 1 of tile t: 8 rows x 4 unsigned bytes each.
static inline __attribute__((always_inline)) void kquad_pair_half(const QWeight* w, int64_t t,
                                                                  int64_t s, int h,
                                                                  const int BITS, __m256i* lo,
                                                                  __m256i* hi) {
  const int64_t K = w->K;
  if (BITS == 8) {
    const uint8_t* v = w->qs + (t * (K / 4) + 2 * s) * 64 + 32 * h;
    *lo = _mm256_loadu_si256((const __m256i*)v);
    *hi = _mm256_loadu_si256((const __m256i*)(v + 64));
    return;
  }
  const __m256i v = _mm256_loadu_si256((const __m256i*)(w->qs + (t * (K / 8) + s) * 64 + 32 * h));
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256i l = _mm256_and_si256(v, low4), u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  if (BITS > 4) {
    const uint64_t* m = (const uint64_t*)(w->qh + (t * (K / 8) + s) * 16 * (BITS - 4));
    for (int p = 0; p < BITS - 4; p++) {  // bit 4 + p is still clear: an or sets it
      const __m256i bit = _mm256_set1_epi8((char)(1 << (4 + p)));
      l = _mm256_or_si256(l, mask_bytes((uint32_t)(m[2 * p] >> (32 * h)), bit));
      u = _mm256_or_si256(u, mask_bytes((uint32_t)(m[2 * p + 1] >> (32 * h)), bit));
    }
  }
  *lo = l;
  *hi = u;
}

// acc[j] lane r = the dot of activation row m0 + j with row 16 t + 8 h + r.
static inline __attribute__((always_inline)) void tile_dots_half(
    const QWeight* w, int64_t t, int h, const QAct* a, int64_t m0, const int MT, const int BITS,
    const int G, const int MINS, const int KIND, __m256 acc[MT_MAX]) {
  const int64_t K = w->K, subs = K / G;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int j = 0; j < MT; j++) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < subs; g++) {
    __m256i sum[MT_MAX];
    for (int j = 0; j < MT; j++)
      sum[j] = BITS == 8 ? _mm256_setzero_si256() : _mm256_set1_epi32(a->corr[(m0 + j) * subs + g]);
    for (int64_t s = g * G / 8; s < (g + 1) * G / 8; s++) {
      __m256i lo, hi;
      kquad_pair_half(w, t, s, h, BITS, &lo, &hi);
      if (BITS == 8) {  // signed q = stored ^ 0x80; then |q| as u8, sign(q) onto x
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        lo = _mm256_xor_si256(lo, flip);
        hi = _mm256_xor_si256(hi, flip);
      }
      const __m256i alo = BITS == 8 ? _mm256_abs_epi8(lo) : lo;
      const __m256i ahi = BITS == 8 ? _mm256_abs_epi8(hi) : hi;
      for (int j = 0; j < MT; j++) {
        const int32_t* x4 = (const int32_t*)(a->q + (m0 + j) * K + 8 * s);
        __m256i xl = _mm256_set1_epi32(x4[0]), xh = _mm256_set1_epi32(x4[1]);
        if (BITS == 8) {
          xl = _mm256_sign_epi8(xl, lo);
          xh = _mm256_sign_epi8(xh, hi);
          const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(alo, xl), ones);
          const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(ahi, xh), ones);
          sum[j] = _mm256_add_epi32(sum[j], _mm256_add_epi32(pl, ph));
        } else {
          const __m256i p =
              _mm256_add_epi16(_mm256_maddubs_epi16(alo, xl), _mm256_maddubs_epi16(ahi, xh));
          sum[j] = _mm256_add_epi32(sum[j], _mm256_madd_epi16(p, ones));
        }
      }
    }
    const __m256 ws = load_scales8(w, 0, t, g, h, KIND);
    for (int j = 0; j < MT; j++) {
      const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(a->d[(m0 + j) * subs + g]));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[j]), scale, acc[j]);
      if (MINS)
        acc[j] = _mm256_fnmadd_ps(load_scales8(w, 1, t, g, h, KIND),
                                  _mm256_set1_ps(a->dsum[(m0 + j) * subs + g]), acc[j]);
    }
  }
}

// out[j][r] = dot of activation row m0 + j with row 16 t + r (both halves).
static inline __attribute__((always_inline)) void tile_dots_avx2(
    const QWeight* w, int64_t t, const QAct* a, int64_t m0, const int MT, const int BITS,
    const int G, const int MINS, const int KIND, float out[MT_MAX][TILE]) {
  for (int h = 0; h < 2; h++) {
    __m256 acc[MT_MAX];
    tile_dots_half(w, t, h, a, m0, MT, BITS, G, MINS, KIND, acc);
    for (int j = 0; j < MT; j++) _mm256_storeu_ps(out[j] + 8 * h, acc[j]);
  }
}

#define TILE_DOTS_AVX2_FOR(NAME, BITS, G, MINS, KIND)                                        \
  static void tile_dots_avx2_##NAME(const QWeight* w, int64_t t, const QAct* a, int64_t m0,   \
                                    int mt, float out[MT_MAX][TILE]) {                        \
    switch (mt) {                                                                             \
      case 4: tile_dots_avx2(w, t, a, m0, 4, BITS, G, MINS, KIND, out); break;                \
      case 3: tile_dots_avx2(w, t, a, m0, 3, BITS, G, MINS, KIND, out); break;                \
      case 2: tile_dots_avx2(w, t, a, m0, 2, BITS, G, MINS, KIND, out); break;                \
      default: tile_dots_avx2(w, t, a, m0, 1, BITS, G, MINS, KIND, out);                      \
    }                                                                                         \
  }
PACKED_LAYOUTS(TILE_DOTS_AVX2_FOR)

typedef void (*TileDotsAvx2)(const QWeight*, int64_t, const QAct*, int64_t, int,
                             float[MT_MAX][TILE]);

// The kernel of w's layout, or NULL (a combination no GGUF type uses; 8 bits other than q +
// 128, which the sign flip assumes).
static TileDotsAvx2 tile_kernel_avx2(const QWeight* w) {
  if (w->bits == 8 && w->offset != 128) return NULL;
#define TILE_DOTS_AVX2_CASE(NAME, BITS, G, MINS, KIND) \
  case LAYOUT_KEY(BITS, G, MINS, KIND): return tile_dots_avx2_##NAME;
  switch (layout_key(w)) {
    PACKED_LAYOUTS(TILE_DOTS_AVX2_CASE)
    default: return NULL;
  }
#undef TILE_DOTS_AVX2_CASE
}
#endif
