// Inner paths of paged_prefill.c: the work item's arguments and scratch, and per tile of KT
// keys the packing of keys/values, the scores of all rows and the online-softmax update of the
// accumulators, in portable C, AVX-512 fp32 and AVX-512 BF16 dot products.
#pragma once
#include "common.h"

#define KT 128  // keys per tile: eight vectors of fp32 scores per row, so that the per-row
               // reductions and rescaling of the online softmax are paid once per 128 keys

typedef struct {
  const void *q, *k_cache, *v_cache;
  const int64_t *block_table, *query_start_loc, *seq_lens;
  void* out;
  int64_t max_blocks, num_heads, num_kv_heads, head_size, block_size, window, q_stride;
  int64_t group, token_stride;
  float scale, k_scale, v_scale;
  int bf16, kind;  // queries / out in bf16; the cache's element kind (KV_*)
} Args;

typedef struct {
  float *acc, *m, *l, *alpha, *rs, *p, *kt, *vf, *qf;
  uint32_t *qb, *pb;
  int64_t rows_cap;
} Scratch;

// Element offset of the cache row of position pos for kv head kh.
static inline int64_t row_offset(const Args* a, const int64_t* table, int64_t pos, int64_t kh) {
  return (table[pos / a->block_size] * a->block_size + pos % a->block_size) * a->token_stride +
         kh * a->head_size;
}

// ---------------------------------------------------------------- portable (fp32 layouts)
// kt: keys transposed, [head_size][KT]; vf: values, [KT][head_size]; rows past `hi` are zero.
static void pack_f32(const Args* a, const int64_t* table, int64_t kh, int64_t t0, int64_t hi,
                     float* kt, float* vf, float* tmp) {
  const int64_t d = a->head_size;
  for (int64_t j = 0; j < KT; j++) {
    if (t0 + j < hi) {
      const int64_t off = row_offset(a, table, t0 + j, kh);
      load_kv_row(a->k_cache, off, d, a->kind, a->k_scale, tmp);
      load_kv_row(a->v_cache, off, d, a->kind, a->v_scale, vf + j * d);
    } else {
      memset(tmp, 0, sizeof(float) * d);
      memset(vf + j * d, 0, sizeof(float) * d);
    }
    for (int64_t x = 0; x < d; x++) kt[x * KT + j] = tmp[x];
  }
}

static void qk_f32(const float* qf, const float* kt, float* p, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; r++) {
    float s[KT] = {0};
    for (int64_t x = 0; x < d; x++) {
      const float qx = qf[r * d + x];
#pragma omp simd
      for (int j = 0; j < KT; j++) s[j] += qx * kt[x * KT + j];
    }
    memcpy(p + r * KT, s, sizeof s);
  }
}

// Online softmax update of row r over the tile's valid lanes jlo..jhi (scores in p[r], scaled);
// leaves the probabilities in p[r] (0 outside) and the accumulator's rescale factor in alpha[r].
static inline void softmax_row(Scratch* s, int64_t r, int64_t jlo, int64_t jhi) {
  float* pr = s->p + r * KT;
  if (jlo > jhi) {
    memset(pr, 0, sizeof(float) * KT);
    s->alpha[r] = 1.f;
    return;
  }
  float mx = -INFINITY;
  for (int64_t j = jlo; j <= jhi; j++) mx = pr[j] > mx ? pr[j] : mx;
  const float m_new = mx > s->m[r] ? mx : s->m[r];
  float sum = 0.f;
  for (int64_t j = 0; j < KT; j++) {
    pr[j] = (j >= jlo && j <= jhi) ? expf(pr[j] - m_new) : 0.f;
    sum += pr[j];
  }
  s->alpha[r] = expf(s->m[r] - m_new);
  s->l[r] = s->l[r] * s->alpha[r] + sum;
  s->m[r] = m_new;
}

static void pv_f32(Scratch* s, const float* vf, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; r++) {
    float* restrict acc = s->acc + r * d;
    const float al = s->alpha[r];
    const float* pr = s->p + r * KT;
#pragma omp simd
    for (int64_t x = 0; x < d; x++) acc[x] *= al;
    for (int j = 0; j < KT; j++) {
      const float pj = pr[j];
      if (pj == 0.f) continue;
#pragma omp simd
      for (int64_t x = 0; x < d; x++) acc[x] += pj * vf[j * d + x];
    }
  }
}

#ifdef PAGEDLM_AVX512
// ---------------------------------------------------------------- AVX-512 fp32
static inline __attribute__((always_inline)) void pack_f32_avx512(const Args* a,
                                                                  const int64_t* table,
                                                                  int64_t kh, int64_t t0,
                                                                  int64_t hi, float* kt, float* vf,
                                                                  const int DV, int kn) {
  const int64_t d = 16 * DV;
  for (int kg = 0; kg < kn; kg += 16) {
    for (int c = 0; c < DV; c++) {
      __m512 r[16];
      for (int j = 0; j < 16; j++)
        r[j] = t0 + kg + j < hi ? load16_kv(a->k_cache,
                                            row_offset(a, table, t0 + kg + j, kh) + 16 * c,
                                            a->kind, a->k_scale)
                                : _mm512_setzero_ps();
      transpose16(r);
      for (int x = 0; x < 16; x++) _mm512_storeu_ps(kt + (16 * c + x) * KT + kg, r[x]);
    }
  }
  for (int j = 0; j < kn; j++) {
    const int valid = t0 + j < hi;
    const int64_t off = valid ? row_offset(a, table, t0 + j, kh) : 0;
    for (int c = 0; c < DV; c++)
      _mm512_storeu_ps(vf + j * d + 16 * c, valid ? load16_kv(a->v_cache, off + 16 * c, a->kind,
                                                              a->v_scale)
                                                  : _mm512_setzero_ps());
  }
}

// Scores of 8 rows at a time (rows are padded to a multiple of 8 with zero queries).
static inline __attribute__((always_inline)) void qk_f32_avx512(const float* qf, const float* kt,
                                                                float* p, int64_t rows,
                                                                const int DV, int kn) {
  const int64_t d = 16 * DV;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    for (int kg = 0; kg < kn; kg += 16) {
      __m512 s[8];
      for (int i = 0; i < 8; i++) s[i] = _mm512_setzero_ps();
      for (int64_t x = 0; x < d; x++) {
        const __m512 k = _mm512_loadu_ps(kt + x * KT + kg);
        for (int i = 0; i < 8; i++)
          s[i] = _mm512_fmadd_ps(_mm512_set1_ps(qf[(r0 + i) * d + x]), k, s[i]);
      }
      for (int i = 0; i < 8; i++) _mm512_storeu_ps(p + (r0 + i) * KT + kg, s[i]);
    }
  }
}

// Lanes kg .. kg + 15 of a row that lie in jlo .. jhi.
static inline __mmask16 lane_mask(int kg, int64_t jlo, int64_t jhi) {
  const int64_t lo = jlo - kg, hi = jhi - kg;  // in lane units
  const uint32_t upto = hi >= 15 ? 0xFFFFu : hi < 0 ? 0u : (1u << (hi + 1)) - 1;
  const uint32_t below = lo <= 0 ? 0u : lo >= 16 ? 0xFFFFu : (1u << lo) - 1;
  return (__mmask16)(upto & ~below);
}

// softmax_row on one vector; lanes outside jlo..jhi are masked off (garbage scores allowed).
// The probabilities go to p[r] as fp32, or with pb (the BF16 path) to pb[r] as bf16 only.
static inline void softmax_row_avx512(Scratch* s, int64_t r, int64_t jlo, int64_t jhi, int kn,
                                      uint32_t* pb) {
  float* pr = s->p + r * KT;
  uint16_t* pbr = pb != NULL ? (uint16_t*)(pb + r * (KT / 2)) : NULL;
  if (jlo > jhi) {
    for (int kg = 0; kg < kn; kg += 16) {
      if (pbr != NULL) _mm256_storeu_si256((__m256i*)(pbr + kg), _mm256_setzero_si256());
      else _mm512_storeu_ps(pr + kg, _mm512_setzero_ps());
    }
    s->alpha[r] = 0.f;
    s->rs[r] = 0.f;
    return;
  }
  const int whole = jlo == 0 && jhi >= kn - 1;  // most tiles: no lane masked
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int kg = 0; kg < kn; kg += 16) {
    const __mmask16 lanes = whole ? 0xFFFF : lane_mask(kg, jlo, jhi);
    mx = _mm512_mask_max_ps(mx, lanes, mx, _mm512_loadu_ps(pr + kg));
  }
  const float tile_max = _mm512_reduce_max_ps(mx);
  const float m_new = tile_max > s->m[r] ? tile_max : s->m[r];
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int kg = 0; kg < kn; kg += 16) {
    const __mmask16 lanes = whole ? 0xFFFF : lane_mask(kg, jlo, jhi);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp2_512(_mm512_sub_ps(_mm512_loadu_ps(pr + kg), vm)));
    if (pbr != NULL) _mm256_storeu_si256((__m256i*)(pbr + kg), (__m256i)_mm512_cvtneps_pbh(e));
    else _mm512_storeu_ps(pr + kg, e);
    sum = _mm512_add_ps(sum, e);
  }
  s->alpha[r] = s->m[r] - m_new;  // the rescale factor's exponent: see rescale_rows_avx512
  s->rs[r] = _mm512_reduce_add_ps(sum);
  s->m[r] = m_new;
}

// After softmax_row_avx512 of every row: alpha = 2^alpha and l = l * alpha + rs, 16 rows a
// vector (one exp2_512 instead of a scalar exp2f per row and tile).
static inline void rescale_rows_avx512(Scratch* s, int64_t rows) {
  for (int64_t r = 0; r < rows; r += 16) {
    const __mmask16 k = rows - r >= 16 ? 0xFFFF : (__mmask16)((1u << (rows - r)) - 1);
    const __m512 alpha = exp2_512(_mm512_maskz_loadu_ps(k, s->alpha + r));
    _mm512_mask_storeu_ps(s->alpha + r, k, alpha);
    const __m512 l = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s->l + r), alpha,
                                     _mm512_maskz_loadu_ps(k, s->rs + r));
    _mm512_mask_storeu_ps(s->l + r, k, l);
  }
}

// acc[r] = acc[r] * alpha[r] + p[r] . V, two rows at a time where the accumulators fit.
static inline __attribute__((always_inline)) void pv_f32_avx512(Scratch* s, const float* vf,
                                                                int64_t rows, const int DV,
                                                                int kn) {
  const int64_t d = 16 * DV;
  const int RB = DV <= 8 ? 2 : 1;  // rows are padded to a multiple of 8
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    __m512 acc[2][16];
    for (int i = 0; i < RB; i++) {
      const __m512 al = _mm512_set1_ps(s->alpha[r0 + i]);
      for (int c = 0; c < DV; c++)
        acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(s->acc + (r0 + i) * d + 16 * c), al);
    }
    for (int j = 0; j < kn; j++) {
      __m512 pj[2];
      for (int i = 0; i < RB; i++) pj[i] = _mm512_set1_ps(s->p[(r0 + i) * KT + j]);
      for (int c = 0; c < DV; c++) {
        const __m512 v = _mm512_loadu_ps(vf + j * d + 16 * c);
        for (int i = 0; i < RB; i++) acc[i][c] = _mm512_fmadd_ps(pj[i], v, acc[i][c]);
      }
    }
    for (int i = 0; i < RB; i++)
      for (int c = 0; c < DV; c++) _mm512_storeu_ps(s->acc + (r0 + i) * d + 16 * c, acc[i][c]);
  }
}
#endif

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

// kp: keys as bf16 pairs, [head_size / 2][KT] 32-bit; vp: values as pairs of tokens,
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
      for (int x = 0; x < 16; x++) _mm512_storeu_ps((float*)kp + (16 * c + x) * KT + kg, r[x]);
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

static inline __attribute__((always_inline)) void qk_bf16(const uint32_t* qb, const uint32_t* kp,
                                                          float* p, int64_t rows, float scale,
                                                          const int DV, int kn) {
  const int64_t dp = 8 * DV;  // pairs per row
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    for (int kg = 0; kg < kn; kg += 16) {
      __m512 s[8];
      for (int i = 0; i < 8; i++) s[i] = _mm512_setzero_ps();
      for (int64_t x = 0; x < dp; x++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kp + x * KT + kg);
        for (int i = 0; i < 8; i++)
          s[i] =
              _mm512_dpbf16_ps(s[i], (__m512bh)_mm512_set1_epi32((int)qb[(r0 + i) * dp + x]), k);
      }
      for (int i = 0; i < 8; i++)
        _mm512_storeu_ps(p + (r0 + i) * KT + kg, _mm512_mul_ps(s[i], vscale));
    }
  }
}

static inline __attribute__((always_inline)) void pv_bf16(Scratch* s, const uint16_t* vp,
                                                          int64_t rows, const int DV, int kn) {
  const int64_t d = 16 * DV;
  const int RB = DV == 4 ? 4 : DV == 8 ? 2 : 1;  // 16 accumulators; rows: a multiple of 8
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    __m512 acc[4][16];
    for (int i = 0; i < RB; i++) {
      const __m512 al = _mm512_set1_ps(s->alpha[r0 + i]);
      for (int c = 0; c < DV; c++)
        acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(s->acc + (r0 + i) * d + 16 * c), al);
    }
    for (int jp = 0; jp < kn / 2; jp++) {
      __m512bh pp[4];
      for (int i = 0; i < RB; i++)
        pp[i] = (__m512bh)_mm512_set1_epi32((int)s->pb[(r0 + i) * (KT / 2) + jp]);
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
