// The tiles and microkernels of gguf_gemm.c (AVX-512 VNNI): a tile pair is 32 output columns
// (two packed 16-row tiles); a microkernel computes MR activation rows x those 32 columns.
#pragma once
#include "gguf_common.h"

#ifdef PAGEDLM_VNNI
#define NT 32     // output columns per tile pair (two 16-lane vectors)
#define MR_MAX 6  // activation rows per microkernel call

// Activations as the microkernels read them, in panels of MR_MAX rows (row m is slot m % MR_MAX
// of panel m / MR_MAX; a last panel's missing slots are never read: its microkernel takes
// MR < MR_MAX rows), so that a microkernel finds its rows' values for one step side by side.
// Per panel: int8 quants [K / 4][MR_MAX][4]; d per activation block of QB values
// [K / QB][MR_MAX]; per weight sub-block g (G values) corr = -offset * (sum of its quants)
// [K / G][MR_MAX] and, for weights with mins, that sum itself [K / G][MR_MAX].
typedef struct {
  int8_t* q;
  float* d;
  int32_t* corr;
  int32_t* sums;  // weights with mins, else NULL
} Acts;

// Where a microkernel reads the quads of a tile pair: half h's quad q (16 rows x 4 bytes, VNNI
// order) at half[h] + 64 q, as the packed tiles hold 8-bit quants. Those of a full pair are
// read in place; others are unpacked into the thread's scratch in the same layout.
typedef struct {
  const uint8_t* half[2];
} Quads;

// The quads of tile pair tp (tiles 2 tp, 2 tp + 1; a missing second tile reads as zeros): in
// place, or unpacked into wt [2][K / 4][64].
static inline __attribute__((always_inline)) Quads unpack_quads(const QWeight* w, int64_t tp,
                                                                uint8_t* restrict wt,
                                                                const int BITS) {
  const int64_t tiles = num_tiles(w), quads = w->K / 4;
  if (BITS == 8 && 2 * tp + 1 < tiles) {
    const uint8_t* first = w->qs + 2 * tp * quads * 64;
    return (Quads){{first, first + quads * 64}};
  }
  for (int half = 0; half < 2; half++) {
    const int64_t t = 2 * tp + half;
    uint8_t* to = wt + half * quads * 64;
    for (int64_t s = 0; s < w->K / 8; s++) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      if (t < tiles) kquad_pair(w, t, s, BITS, &lo, &hi);
      _mm512_store_si512(to + 2 * s * 64, lo);
      _mm512_store_si512(to + (2 * s + 1) * 64, hi);
    }
  }
  return (Quads){{wt, wt + quads * 64}};
}

static Quads unpack_quads_any(const QWeight* w, int64_t tp, uint8_t* wt) {
  switch (w->bits) {
    case 4: return unpack_quads(w, tp, wt, 4);
    case 5: return unpack_quads(w, tp, wt, 5);
    case 6: return unpack_quads(w, tp, wt, 6);
    default: return unpack_quads(w, tp, wt, 8);
  }
}

// 16 values of tile t's field at [t][index][16], or zeros past the last tile.
static inline __m512i tile_bytes16(const QWeight* w, const void* field, int64_t t, int64_t index,
                                   int64_t per_tile) {
  if (t >= num_tiles(w)) return _mm512_setzero_si512();
  const uint8_t* at = (const uint8_t*)field + (t * per_tile + index) * TILE;
  const __m128i b = _mm_loadu_si128((const __m128i*)at);
  return w->kind == SCALES_I8_SUPER ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}
static inline __m512 tile_floats16(const QWeight* w, const float* field, int64_t t, int64_t index,
                                   int64_t per_tile) {
  if (t >= num_tiles(w)) return _mm512_setzero_ps();
  return _mm512_loadu_ps(field + (t * per_tile + index) * TILE);
}

// Float scales (and mins) of tile pair tp as [K / G][32] (blocks of 32 and the fp32 path).
static void unpack_scales(const QWeight* w, int64_t tp, float* restrict sT, float* restrict mT) {
  for (int half = 0; half < 2; half++) {
    const int64_t t = 2 * tp + half;
    const int in = t < num_tiles(w);
    for (int64_t g = 0; g < w->K / w->group; g++) {
      const __m512 zero = _mm512_setzero_ps();
      __m512 s = zero, m = zero;
      switch (w->kind) {
        case SCALES_F16:
          if (in) s = load_scales16(w, 0, t, g, SCALES_F16);
          if (in && mT != NULL) m = load_scales16(w, 1, t, g, SCALES_F16);
          break;
        default:
          if (in) s = load_scales16(w, 0, t, g, SCALES_F32);
          if (in && mT != NULL) m = load_scales16(w, 1, t, g, SCALES_F32);
      }
      _mm512_store_ps(sT + g * NT + TILE * half, s);
      if (mT != NULL) _mm512_store_ps(mT + g * NT + TILE * half, m);
    }
  }
}

// K-quant scales of tile pair tp: integer sub-scales (and mins) [K / G][32], the super-blocks'
// d (and dmin) [K / 256][32].
static void unpack_kscales(const QWeight* w, int64_t tp, int32_t* restrict sc,
                           int32_t* restrict mn, float* restrict sup, float* restrict msup) {
  const int64_t subs = w->K / w->group, supers = w->K / 256;
  for (int half = 0; half < 2; half++) {
    const int64_t t = 2 * tp + half;
    for (int64_t g = 0; g < subs; g++) {
      _mm512_store_si512(sc + g * NT + TILE * half, tile_bytes16(w, w->scales, t, g, subs));
      if (mn != NULL)
        _mm512_store_si512(mn + g * NT + TILE * half, tile_bytes16(w, w->mins, t, g, subs));
    }
    for (int64_t s = 0; s < supers; s++) {
      _mm512_store_ps(sup + s * NT + TILE * half, tile_floats16(w, w->sup, t, s, supers));
      if (msup != NULL)
        _mm512_store_ps(msup + s * NT + TILE * half, tile_floats16(w, w->msup, t, s, supers));
    }
  }
}

// acc[i][h] = corr of sub-block g + its G / 4 VNNI steps (weight quant u8 x activation s8);
// q and corr: the panel's.
static inline __attribute__((always_inline)) void sub_block_dots(Quads wq, const int8_t* q,
                                                                 const int32_t* corr, int64_t g,
                                                                 const int MR, const int G,
                                                                 __m512i acc[MR_MAX][2]) {
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_set1_epi32(corr[g * MR_MAX + i]);
  const uint8_t* w0p = wq.half[0] + g * (G / 4) * 64;
  const uint8_t* w1p = wq.half[1] + g * (G / 4) * 64;
  const int8_t* qg = q + g * G * MR_MAX;
  for (int s = 0; s < G / 4; s++) {
    const __m512i w0 = _mm512_loadu_si512(w0p + s * 64);
    const __m512i w1 = _mm512_loadu_si512(w1p + s * 64);
    for (int i = 0; i < MR; i++) {
      int32_t v;
      memcpy(&v, qg + (s * MR_MAX + i) * 4, 4);
      const __m512i av = _mm512_set1_epi32(v);
      acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w0, av);
      acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], w1, av);
    }
  }
}

// Blocks of 32 (and 16, never packed so far): out[i][0 .. 31] = dots of the MR rows of panel p.
// Per weight sub-block, t += (float)(int dot) * scale (- min * quant sum); per activation block
// of QB values, out += t * da. With QB > G the activation scale is applied once per QB / G
// sub-blocks: one float operation per sub-block less (each takes a vpdpbusd's pipe slot).
static inline __attribute__((always_inline)) void micro(Quads wq, const float* restrict sT,
                                                        const float* restrict mT, const Acts* a,
                                                        int64_t K, int64_t p, const int MR,
                                                        const int G, const int QB,
                                                        const int MINS, float* out) {
  const int64_t subs = K / G, per = QB / G;
  const int8_t* q = a->q + p * K * MR_MAX;
  const int32_t* corr = a->corr + p * subs * MR_MAX;
  const int32_t* sums = MINS ? a->sums + p * subs * MR_MAX : NULL;
  const float* da = a->d + p * (K / QB) * MR_MAX;
  memset(out, 0, sizeof(float) * MR * NT);
  for (int64_t ab = 0; ab < K / QB; ab++) {
    __m512 t[MR_MAX][2];
    for (int i = 0; i < MR; i++) t[i][0] = t[i][1] = _mm512_setzero_ps();
    for (int64_t g = ab * per; g < (ab + 1) * per; g++) {
      __m512i acc[MR_MAX][2];
      sub_block_dots(wq, q, corr, g, MR, G, acc);
      const __m512 s0 = _mm512_load_ps(sT + g * NT), s1 = _mm512_load_ps(sT + g * NT + 16);
      for (int i = 0; i < MR; i++) {
        t[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][0]), s0, t[i][0]);
        t[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1]), s1, t[i][1]);
      }
      if (MINS) {
        const __m512 n0 = _mm512_load_ps(mT + g * NT), n1 = _mm512_load_ps(mT + g * NT + 16);
        for (int i = 0; i < MR; i++) {
          const __m512 sv = _mm512_set1_ps((float)sums[g * MR_MAX + i]);
          t[i][0] = _mm512_fnmadd_ps(n0, sv, t[i][0]);
          t[i][1] = _mm512_fnmadd_ps(n1, sv, t[i][1]);
        }
      }
    }
    for (int i = 0; i < MR; i++) {
      const __m512 dv = _mm512_set1_ps(da[ab * MR_MAX + i]);
      for (int h = 0; h < 2; h++) {
        float* o = out + i * NT + 16 * h;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(t[i][h], dv, _mm512_loadu_ps(o)));
      }
    }
  }
}

// K-quants: one activation scale per 256 values, so each sub-block's int32 dot is multiplied
// by its integer sub-scale and summed over the super-block in int32 (exact: |sum| < 2^31 for
// 6-bit quants x 8-bit scales x 127); the float scaling happens once per 256 values:
// out += da * (d * sum(scale * dot) - dmin * sum(min * quant sum)).
static inline __attribute__((always_inline)) void micro_k(Quads wq, const int32_t* restrict sc,
                                                          const int32_t* restrict mn,
                                                          const float* restrict sup,
                                                          const float* restrict msup,
                                                          const Acts* a, int64_t K, int64_t p,
                                                          const int MR, const int G,
                                                          const int MINS, float* out) {
  const int64_t subs = K / G, per = 256 / G;
  const int8_t* q = a->q + p * K * MR_MAX;
  const int32_t* corr = a->corr + p * subs * MR_MAX;
  const int32_t* sums = MINS ? a->sums + p * subs * MR_MAX : NULL;
  const float* da = a->d + p * (K / 256) * MR_MAX;
  memset(out, 0, sizeof(float) * MR * NT);
  for (int64_t sb = 0; sb < K / 256; sb++) {
    __m512i tot[MR_MAX][2];
    for (int i = 0; i < MR; i++) tot[i][0] = tot[i][1] = _mm512_setzero_si512();
    for (int64_t g = sb * per; g < (sb + 1) * per; g++) {
      __m512i acc[MR_MAX][2];
      sub_block_dots(wq, q, corr, g, MR, G, acc);
      const __m512i s0 = _mm512_load_si512(sc + g * NT), s1 = _mm512_load_si512(sc + g * NT + 16);
      for (int i = 0; i < MR; i++) {
        tot[i][0] = _mm512_add_epi32(tot[i][0], _mm512_mullo_epi32(acc[i][0], s0));
        tot[i][1] = _mm512_add_epi32(tot[i][1], _mm512_mullo_epi32(acc[i][1], s1));
      }
    }
    for (int i = 0; i < MR; i++) {
      __m512i mins[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int64_t g = sb * per; MINS && g < (sb + 1) * per; g++) {
        const __m512i sv = _mm512_set1_epi32(sums[g * MR_MAX + i]);
        for (int h = 0; h < 2; h++)
          mins[h] = _mm512_add_epi32(
              mins[h], _mm512_mullo_epi32(_mm512_load_si512(mn + g * NT + 16 * h), sv));
      }
      const __m512 dv = _mm512_set1_ps(da[sb * MR_MAX + i]);
      for (int h = 0; h < 2; h++) {
        const __m512 d = _mm512_load_ps(sup + sb * NT + 16 * h);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(tot[i][h]), d);
        if (MINS) {
          const __m512 dmin = _mm512_load_ps(msup + sb * NT + 16 * h);
          v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[h]), dmin, v);
        }
        float* o = out + i * NT + 16 * h;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(v, dv, _mm512_loadu_ps(o)));
      }
    }
  }
}
#endif
