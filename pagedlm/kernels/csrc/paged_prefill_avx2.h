// The fp32 inner path of paged_prefill.c for AVX2 machines (no AVX-512): head sizes that are
// multiples of 16, fp32 or bf16 queries, any cache kind. The same tiles, row blocks and lazy
// reference max (base 2) as the AVX-512 fp32 path, on 8 lanes: keys are transposed in 8 x 8
// blocks, scores computed 4 rows x 16 keys at a time and the weighted values 4 rows x 16
// dimensions. On Zen 3 it runs at 75-80 GFLOP/s on two threads (torch's fp32 GEMM: ~90), the
// portable loop it replaces at ~18.
#pragma once
#include "paged_prefill_tiles.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(PAGEDLM_AVX512)
#define PAGEDLM_PREFILL_AVX2 1

// 8 cache values of any kind -> fp32 (fp8 times `scale`), as load16_kv: fp8 goes through fp16.
static inline __attribute__((always_inline)) __m256 load8_kv_any(const void* base, int64_t offset,
                                                                 int kind, float scale) {
  if (kind == KV_F32) return _mm256_loadu_ps((const float*)base + offset);
  if (kind == KV_BF16) {
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + offset));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  const __m128i w =
      _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)((const uint8_t*)base + offset)));
  if (kind == KV_FP8_E5M2)
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_slli_epi16(w, 8)), _mm256_set1_ps(scale));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f * scale));
}

// 2^x on 8 lanes with exp2_512's polynomial; x is clamped to >= -126 (the scale is built in
// the exponent bits), which leaves 2^-126 where exp2_512 gives 0: below any row sum's rounding.
static inline __m256 exp2_256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.402265069591007e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931471805599453e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// In-place transpose of an 8 x 8 fp32 matrix held in 8 registers.
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// Register blocks: scores QK_R rows x QK_KEYS keys, weighted values PV_R rows x PV_DIMS
// dimensions. The packed tiles are laid out so that each block streams contiguous memory:
// kt is [KT / QK_KEYS][head_size][QK_KEYS] (the keys transposed, a group of QK_KEYS keys for
// every dimension), vf is [head_size / PV_DIMS][KT][PV_DIMS]. (With the row-major [head_size]
// [KT] of the other paths, the score loop strode 1 KiB from dimension to dimension, which maps
// onto four L1 sets: every load missed.)
#define QK_R 4  // 8 accumulators in each: 12 (RB_ROWS 12) measured no faster on Zen 3
#define QK_V 2
#define PV_R 4
#define PV_V 2
#define QK_KEYS (8 * QK_V)
#define PV_DIMS (8 * PV_V)

// Packs keys and values t0 .. t0 + kn - 1 (kn a multiple of 32; those at or past `hi` zero).
static inline __attribute__((always_inline)) void pack_f32_avx2(const Args* a,
                                                                const int64_t* table, int64_t kh,
                                                                int64_t t0, int64_t hi, float* kt,
                                                                float* vf, const int DV, int kn) {
  const int64_t d = 8 * DV;
  for (int kg = 0; kg < kn; kg += 8) {
    int64_t off[8];
    for (int j = 0; j < 8; j++)
      off[j] = t0 + kg + j < hi ? row_offset(a, table, t0 + kg + j, kh) : -1;
    float* group = kt + (kg / QK_KEYS) * d * QK_KEYS + kg % QK_KEYS;
    for (int c = 0; c < DV; c++) {
      __m256 r[8];
      for (int j = 0; j < 8; j++)
        r[j] = off[j] >= 0 ? load8_kv_any(a->k_cache, off[j] + 8 * c, a->kind, a->k_scale)
                           : _mm256_setzero_ps();
      transpose8(r);
      for (int x = 0; x < 8; x++) _mm256_storeu_ps(group + (8 * c + x) * QK_KEYS, r[x]);
    }
    for (int j = 0; j < 8; j++)
      for (int c = 0; c < DV; c++)
        _mm256_storeu_ps(vf + (c / PV_V) * KT * PV_DIMS + (kg + j) * PV_DIMS + 8 * (c % PV_V),
                         off[j] >= 0
                             ? load8_kv_any(a->v_cache, off[j] + 8 * c, a->kind, a->v_scale)
                             : _mm256_setzero_ps());
  }
}

// Scores of a row block (RB_ROWS rows, padded ones with zero queries) over keys 0 .. kn - 1.
static inline __attribute__((always_inline)) void qk_f32_avx2(const float* qf, const float* kt,
                                                              float* p, const int DV, int kn) {
  const int64_t d = 8 * DV;
  for (int kg = 0; kg < kn; kg += QK_KEYS) {
    const float* group = kt + (kg / QK_KEYS) * d * QK_KEYS;
    for (int r0 = 0; r0 < RB_ROWS; r0 += QK_R) {
      __m256 s[QK_R][QK_V];
      for (int i = 0; i < QK_R; i++)
        for (int v = 0; v < QK_V; v++) s[i][v] = _mm256_setzero_ps();
      for (int64_t x = 0; x < d; x++) {
        __m256 k[QK_V];
        for (int v = 0; v < QK_V; v++) k[v] = _mm256_loadu_ps(group + x * QK_KEYS + 8 * v);
        for (int i = 0; i < QK_R; i++) {
          const __m256 q = _mm256_broadcast_ss(qf + (r0 + i) * d + x);
          for (int v = 0; v < QK_V; v++) s[i][v] = _mm256_fmadd_ps(q, k[v], s[i][v]);
        }
      }
      for (int i = 0; i < QK_R; i++)
        for (int v = 0; v < QK_V; v++) _mm256_storeu_ps(p + (r0 + i) * KP + kg + 8 * v, s[i][v]);
    }
  }
}

// All-ones in the lanes kg .. kg + 7 that lie in jlo .. jhi.
static inline __m256 lane_mask8(int kg, int64_t jlo, int64_t jhi) {
  const __m256i j =
      _mm256_add_epi32(_mm256_set1_epi32(kg), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(j, _mm256_set1_epi32((int)jlo - 1)),
                                      _mm256_cmpgt_epi32(_mm256_set1_epi32((int)jhi + 1), j));
  return _mm256_castsi256_ps(in);
}

// softmax_row_avx512 on 8 lanes: the online softmax update of row r over the lanes jlo..jhi
// of its scores pr (base 2; other lanes masked off, garbage allowed), with the lazy reference
// max; the probabilities replace the scores, l[r] keeps 8 per-lane partial sums (of its 16).
static inline void softmax_row_avx2(Scratch* s, float* pr, int64_t r, int64_t jlo, int64_t jhi,
                                    int kn) {
  s->alpha[r] = 1.f;
  if (jlo > jhi) {
    for (int kg = 0; kg < kn; kg += 8) _mm256_storeu_ps(pr + kg, _mm256_setzero_ps());
    return;
  }
  const int whole = jlo == 0 && jhi >= kn - 1;  // most tiles: no lane masked
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 mx = neg_inf;
  for (int kg = 0; kg < kn; kg += 8) {
    const __m256 v = _mm256_loadu_ps(pr + kg);
    mx = _mm256_max_ps(mx, whole ? v : _mm256_blendv_ps(neg_inf, v, lane_mask8(kg, jlo, jhi)));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float m_tile = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  float* lr = s->l + 16 * r;
  __m256 sum = _mm256_loadu_ps(lr);
  if (m_tile > s->m[r] + MAX_SLACK) {
    s->alpha[r] = exp2f(s->m[r] - m_tile);  // 0 on the row's first tile (m = -inf)
    s->m[r] = m_tile;
    sum = _mm256_mul_ps(sum, _mm256_set1_ps(s->alpha[r]));
  }
  const __m256 vm = _mm256_set1_ps(s->m[r]);
  for (int kg = 0; kg < kn; kg += 8) {
    __m256 e = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(pr + kg), vm));
    if (!whole) e = _mm256_and_ps(e, lane_mask8(kg, jlo, jhi));
    _mm256_storeu_ps(pr + kg, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_storeu_ps(lr, sum);
}

// Rows rb .. rb + RB_ROWS - 1 (probabilities in p): acc = acc * alpha + p . V, over keys
// 0 .. kn - 1.
static inline __attribute__((always_inline)) void pv_f32_avx2(Scratch* s, const float* vf,
                                                              int64_t rb, const int DV, int kn) {
  const int64_t d = 8 * DV;
  for (int c0 = 0; c0 < DV; c0 += PV_V) {
    const float* chunk = vf + (c0 / PV_V) * KT * PV_DIMS;
    for (int64_t r0 = rb; r0 < rb + RB_ROWS; r0 += PV_R) {
      const float* p0 = s->p + (r0 - rb) * KP;
      __m256 acc[PV_R][PV_V];
      for (int i = 0; i < PV_R; i++) {
        const __m256 al = _mm256_set1_ps(s->alpha[r0 + i]);
        for (int c = 0; c < PV_V; c++)
          acc[i][c] = _mm256_mul_ps(_mm256_loadu_ps(s->acc + (r0 + i) * d + 8 * (c0 + c)), al);
      }
      for (int j = 0; j < kn; j++) {
        __m256 v[PV_V];
        for (int c = 0; c < PV_V; c++) v[c] = _mm256_loadu_ps(chunk + j * PV_DIMS + 8 * c);
        for (int i = 0; i < PV_R; i++) {
          const __m256 pi = _mm256_broadcast_ss(p0 + i * KP + j);
          for (int c = 0; c < PV_V; c++) acc[i][c] = _mm256_fmadd_ps(pi, v[c], acc[i][c]);
        }
      }
      for (int i = 0; i < PV_R; i++)
        for (int c = 0; c < PV_V; c++)
          _mm256_storeu_ps(s->acc + (r0 + i) * d + 8 * (c0 + c), acc[i][c]);
    }
  }
}
#endif
