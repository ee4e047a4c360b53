// The AVX-512 BF16 inner path of paged_prefill.c (bf16 queries, bf16 or fp8 caches): key/value
// tiles packed into bf16 pairs, scores by vdpbf16ps, a softmax that writes bf16 probabilities,
// and the weighted values by vdpbf16ps. Defines PAGEDLM_PREFILL_BF16 where the CPU has it.
#pragma once
#include "paged_prefill_tiles.h"

#if defined(PAGEDLM_AVX512) && defined(__AVX512BF16__)
#define PAGEDLM_PREFILL_BF16 1
// ---------------------------------------------------------------- AVX-512 BF16 dot products
// 16 bf16 of the cache row (bf16, or fp8 rounded to bf16) as raw bits.
static inline __m256i load16_bf16_bits(const Args* a, const void* cache, int64_t off,
                                       float scale) {
  if (a->kind == KV_BF16)
    return _mm256_loadu_si256((const __m256i*)((const uint16_t*)cache + off));
  return (__m256i)_mm512_cvtneps_pbh(load16_kv(cache, off, a->kind, scale));
}

// kp: keys as bf16 pairs, [head_size / 2][KP] 32-bit (KT used); vp: values as pairs of tokens,
// [KT / 2][head_size][2] bf16 (lane x of vector (jp, c) = tokens 2jp, 2jp + 1 of dim 16c + x).
static inline __attribute__((always_inline)) void pack_bf16(const Args* a, const int64_t* table,
                                                            int64_t kh, int64_t t0, int64_t hi,
                                                            uint32_t* kp, uint16_t* vp,
                                                            const int DV, int kn) {
  const int64_t d = 16 * DV;
  int64_t off[KT];
  for (int j = 0; j < kn; j++) off[j] = t0 + j < hi ? row_offset(a, table, t0 + j, kh) : -1;
  for (int kg = 0; kg < kn; kg += 16) {
    for (int c = 0; c < DV / 2; c++) {  // 32 dims = 16 pairs per key
      __m512 r[16];
      for (int j = 0; j < 16; j++) {
        const int64_t o = off[kg + j];
        if (o < 0) {
          r[j] = _mm512_setzero_ps();
          continue;
        }
        const __m256i lo = load16_bf16_bits(a, a->k_cache, o + 32 * c, a->k_scale);
        const __m256i hi16 = load16_bf16_bits(a, a->k_cache, o + 32 * c + 16, a->k_scale);
        r[j] = _mm512_castsi512_ps(
            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi16, 1));  // 16 pairs of key j
      }
      transpose16(r);
      for (int x = 0; x < 16; x++) _mm512_storeu_ps((float*)kp + (16 * c + x) * KP + kg, r[x]);
    }
  }
  const __m512i lo_idx = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003,
                                           0x00240004, 0x00250005, 0x00260006, 0x00270007,
                                           0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                           0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int jp = 0; jp < kn / 2; jp++) {
    for (int c = 0; c < DV / 2; c++) {
      __m512i rows[2];
      for (int e = 0; e < 2; e++) {
        const int64_t o = off[2 * jp + e];
        if (o < 0) {
          rows[e] = _mm512_setzero_si512();
          continue;
        }
        const __m256i lo = load16_bf16_bits(a, a->v_cache, o + 32 * c, a->v_scale);
        const __m256i hi16 = load16_bf16_bits(a, a->v_cache, o + 32 * c + 16, a->v_scale);
        rows[e] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi16, 1);
      }
      uint16_t* dst = vp + (jp * d + 32 * c) * 2;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(rows[0], lo_idx, rows[1]));
      _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(rows[0], hi_idx, rows[1]));
    }
  }
}

// 2^x to within 7.5e-5 (relative; a degree-3 polynomial in x - floor(x)), for probabilities
// rounded to bf16 (2^-9) next; lanes off `lanes` are 0, whatever their x.
static inline __m512 exp2_bf16_512(__mmask16 lanes, __m512 x) {
  const __m512 f = _mm512_reduce_ps(x, 0x09);  // x - floor(x), in [0, 1)
  __m512 p = _mm512_set1_ps(0.07802452147006989f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2260671705007553f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6958335041999817f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999251961708069f));
  return _mm512_maskz_scalef_ps(lanes, p, x);  // p * 2^floor(x)
}

// Probabilities 2^(score * scale - m) of one row's tile as bf16 (pbr), two vectors per step;
// adds their sum to the 16 lanes of *sum (by dot products with ones, pairs of keys per lane).
// Returns 0 when some lane's sum exceeds 2^MAX_SLACK (then a probability may be that large).
static inline __attribute__((always_inline)) int exp_tile_bf16(const float* pr, uint16_t* pbr,
                                                               float m, float scale, int64_t jlo,
                                                               int64_t jhi, int kn, __m512* sum) {
  const int whole = jlo == 0 && jhi >= kn - 1;  // most tiles: no lane masked
  const __m512 vm = _mm512_set1_ps(m), vscale = _mm512_set1_ps(scale);
  const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3F803F80);
  __m512 t = _mm512_setzero_ps();
  for (int kg = 0; kg < kn; kg += 32) {
    const __mmask16 lo = whole ? 0xFFFF : lane_mask(kg, jlo, jhi);
    const __mmask16 hi = whole ? 0xFFFF : lane_mask(kg + 16, jlo, jhi);
    const __m512 e0 = exp2_bf16_512(lo, _mm512_fmsub_ps(_mm512_loadu_ps(pr + kg), vscale, vm));
    const __m512 e1 = exp2_bf16_512(hi, _mm512_fmsub_ps(_mm512_loadu_ps(pr + kg + 16), vscale, vm));
    const __m512bh pb = _mm512_cvtne2ps_pbh(e1, e0);  // keys kg .. kg + 31 in order
    _mm512_storeu_si512(pbr + kg, (__m512i)pb);
    t = _mm512_dpbf16_ps(t, pb, ones);
  }
  *sum = _mm512_add_ps(*sum, t);
  return !_mm512_cmp_ps_mask(t, _mm512_set1_ps(exp2f(MAX_SLACK)), _CMP_GT_OQ);
}

// softmax_row_avx512 for the BF16 path: raw scores in pr (times scale: base 2), probabilities
// as bf16 to pbr, summed as rounded. The max is taken only on a row's first tile and when the
// tile's sums say a probability may exceed 2^MAX_SLACK (then the tile is redone).
static inline __attribute__((always_inline)) void softmax_row_bf16(Scratch* s, const float* pr,
                                                                   uint16_t* pbr, int64_t r,
                                                                   int64_t jlo, int64_t jhi,
                                                                   int kn, float scale) {
  s->alpha[r] = 1.f;
  if (jlo > jhi) {
    for (int kg = 0; kg < kn; kg += 32) _mm512_storeu_si512(pbr + kg, _mm512_setzero_si512());
    return;
  }
  float* lr = s->l + 16 * r;
  __m512 sum = _mm512_loadu_ps(lr);
  if (s->m[r] == -INFINITY || !exp_tile_bf16(pr, pbr, s->m[r], scale, jlo, jhi, kn, &sum)) {
    sum = _mm512_loadu_ps(lr);
    const float tile_max = _mm512_reduce_max_ps(tile_max512(pr, jlo, jhi, kn)) * scale;
    if (tile_max > s->m[r]) sum = raise_max(s, r, tile_max, sum);
    exp_tile_bf16(pr, pbr, s->m[r], scale, jlo, jhi, kn, &sum);
  }
  _mm512_storeu_ps(lr, sum);
}

// Raw scores (q . k) of `rows` rows (a multiple of 4) in blocks of 4 rows x 4 vectors of keys
// (16 accumulators, 8 loads per 16 dot products), a last partial block by single vectors.
static inline __attribute__((always_inline)) void qk_bf16(const uint32_t* qb, const uint32_t* kp,
                                                          float* p, int64_t rows, const int DV,
                                                          int kn) {
  const int64_t dp = 8 * DV;  // pairs per row
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    int kg = 0;
    for (; kg + 64 <= kn; kg += 64) {
      __m512 s[4][4];
      for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) s[i][c] = _mm512_setzero_ps();
      for (int64_t x = 0; x < dp; x++) {
        __m512bh k[4];
        for (int c = 0; c < 4; c++) k[c] = (__m512bh)_mm512_loadu_si512(kp + x * KP + kg + 16 * c);
        for (int i = 0; i < 4; i++) {
          const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qb[(r0 + i) * dp + x]);
          for (int c = 0; c < 4; c++) s[i][c] = _mm512_dpbf16_ps(s[i][c], q, k[c]);
        }
      }
      for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++)
          _mm512_storeu_ps(p + (r0 + i) * KP + kg + 16 * c, s[i][c]);
    }
    for (; kg < kn; kg += 16) {
      __m512 s[4];
      for (int i = 0; i < 4; i++) s[i] = _mm512_setzero_ps();
      for (int64_t x = 0; x < dp; x++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kp + x * KP + kg);
        for (int i = 0; i < 4; i++)
          s[i] =
              _mm512_dpbf16_ps(s[i], (__m512bh)_mm512_set1_epi32((int)qb[(r0 + i) * dp + x]), k);
      }
      for (int i = 0; i < 4; i++)
        _mm512_storeu_ps(p + (r0 + i) * KP + kg, s[i]);
    }
  }
}

// pv_f32_avx512 with bf16 probabilities (pb) and values (vp, pairs of tokens).
static inline __attribute__((always_inline)) void pv_bf16(Scratch* s, const uint16_t* vp,
                                                          int64_t rb, const int DV, int kn) {
  const int64_t d = 16 * DV;
  const int RB = DV == 4 ? 4 : DV == 8 ? 2 : 1;  // 16 accumulators
  for (int64_t r0 = rb; r0 < rb + RB_ROWS; r0 += RB) {
    __m512 acc[4][16];
    for (int i = 0; i < RB; i++)
      for (int c = 0; c < DV; c++) acc[i][c] = load_acc(s, r0 + i, d, c);
    for (int jp = 0; jp < kn / 2; jp++) {
      __m512bh pp[4];
      for (int i = 0; i < RB; i++)
        pp[i] = (__m512bh)_mm512_set1_epi32((int)s->pb[(r0 - rb + i) * (PBP / 2) + jp]);
      for (int c = 0; c < DV; c++) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + (jp * d + 16 * c) * 2);
        for (int i = 0; i < RB; i++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pp[i], v);
      }
    }
    for (int i = 0; i < RB; i++)
      for (int c = 0; c < DV; c++) _mm512_storeu_ps(s->acc + (r0 + i) * d + 16 * c, acc[i][c]);
  }
}
#endif
