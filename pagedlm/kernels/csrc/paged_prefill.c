// Prefill attention over the paged KV cache: tiled, online softmax (flash-attention style).
//
// Every prefill chunk reads its keys and values straight from the cache through the block table
// (the chunk's own keys are written there first), cached prefix or not. Causal masks are
// bottom-right aligned: query row i of a chunk of n tokens in a sequence of seq_len sits at
// position seq_len - n + i and sees keys at positions <= its own (and > its own - window with a
// sliding window). Work items are (request, kv head, tile of query tokens); an item holds the
// rows (token, query head of the kv head's group) of its tile, walks the key range its rows can
// see in tiles of KT keys, converts each key/value tile once into a packed scratch layout and
// keeps a running max, sum and fp32 accumulator per row. Memory: O(rows x head_size + KT x
// head_size) per thread; no mask and no gathered copy of the context exists.
//
// Three inner paths share this structure: portable C (any head size), AVX-512 in fp32
// (head_size % 16 == 0) and AVX-512 BF16 dot products (bf16 queries, bf16 or fp8 cache,
// head_size 64 / 128 / 256); the AVX-512 paths are specialized for those head sizes.
#include <stdlib.h>

#include "common.h"

#define KT 64  // keys per tile: four vectors of fp32 scores per row, so that the per-row
              // reductions and rescaling of the online softmax are paid once per 64 keys

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
  float *acc, *m, *l, *alpha, *p, *kt, *vf, *qf;
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
                                                                  const int DV) {
  const int64_t d = 16 * DV;
  for (int kg = 0; kg < KT; kg += 16) {
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
  for (int j = 0; j < KT; j++) {
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
                                                                const int DV) {
  const int64_t d = 16 * DV;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    for (int kg = 0; kg < KT; kg += 16) {
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

// softmax_row on one vector; lanes outside jlo..jhi are masked off (garbage scores allowed).
static inline void softmax_row_avx512(Scratch* s, int64_t r, int64_t jlo, int64_t jhi) {
  float* pr = s->p + r * KT;
  if (jlo > jhi) {
    for (int kg = 0; kg < KT; kg += 16) _mm512_storeu_ps(pr + kg, _mm512_setzero_ps());
    s->alpha[r] = 1.f;
    return;
  }
  const uint64_t bits = (jhi >= 63 ? ~0ull : (1ull << (jhi + 1)) - 1) & ~((1ull << jlo) - 1);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int kg = 0; kg < KT; kg += 16)
    mx = _mm512_mask_max_ps(mx, (__mmask16)(bits >> kg), mx, _mm512_loadu_ps(pr + kg));
  const float tile_max = _mm512_reduce_max_ps(mx);
  const float m_new = tile_max > s->m[r] ? tile_max : s->m[r];
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int kg = 0; kg < KT; kg += 16) {
    const __m512 sc = _mm512_loadu_ps(pr + kg);
    const __m512 e = _mm512_maskz_mov_ps((__mmask16)(bits >> kg), exp512(_mm512_sub_ps(sc, vm)));
    _mm512_storeu_ps(pr + kg, e);
    sum = _mm512_add_ps(sum, e);
  }
  s->alpha[r] = expf(s->m[r] - m_new);
  s->l[r] = s->l[r] * s->alpha[r] + _mm512_reduce_add_ps(sum);
  s->m[r] = m_new;
}

// acc[r] = acc[r] * alpha[r] + p[r] . V, two rows at a time where the accumulators fit.
static inline __attribute__((always_inline)) void pv_f32_avx512(Scratch* s, const float* vf,
                                                                int64_t rows, const int DV) {
  const int64_t d = 16 * DV;
  const int RB = DV <= 8 ? 2 : 1;  // rows are padded to a multiple of 8
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    __m512 acc[2][16];
    for (int i = 0; i < RB; i++) {
      const __m512 al = _mm512_set1_ps(s->alpha[r0 + i]);
      for (int c = 0; c < DV; c++)
        acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(s->acc + (r0 + i) * d + 16 * c), al);
    }
    for (int j = 0; j < KT; j++) {
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
                                                            const int DV) {
  const int64_t d = 16 * DV;
  int64_t off[KT];
  for (int j = 0; j < KT; j++) off[j] = t0 + j < hi ? row_offset(a, table, t0 + j, kh) : -1;
  for (int kg = 0; kg < KT; kg += 16) {
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
  for (int jp = 0; jp < KT / 2; jp++) {
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
                                                          const int DV) {
  const int64_t dp = 8 * DV;  // pairs per row
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    for (int kg = 0; kg < KT; kg += 16) {
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
                                                          int64_t rows, const int DV) {
  const int64_t d = 16 * DV;
  const int RB = DV <= 8 ? 2 : 1;
  for (int64_t r = 0; r < rows; r++)  // probabilities as bf16 pairs
    for (int kg = 0; kg < KT; kg += 16)
      _mm256_storeu_si256((__m256i*)(s->pb + r * (KT / 2) + kg / 2),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s->p + r * KT + kg)));
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    __m512 acc[2][16];
    for (int i = 0; i < RB; i++) {
      const __m512 al = _mm512_set1_ps(s->alpha[r0 + i]);
      for (int c = 0; c < DV; c++)
        acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(s->acc + (r0 + i) * d + 16 * c), al);
    }
    for (int jp = 0; jp < KT / 2; jp++) {
      __m512bh pp[2];
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

// ---------------------------------------------------------------- one work item
// PATH 0: portable, 1: AVX-512 fp32, 2: AVX-512 BF16. DV = head_size / 16 for paths 1 and 2.
static inline __attribute__((always_inline)) void attend_tile(const Args* a, Scratch* s,
                                                              int64_t req, int64_t kh,
                                                              int64_t i0, int64_t i1,
                                                              const int PATH, const int DV) {
  const int64_t d = a->head_size, G = a->group;
  const int64_t q_start = a->query_start_loc[req];
  const int64_t q_len = a->query_start_loc[req + 1] - q_start;
  const int64_t seq_len = a->seq_lens[req];
  const int64_t pos0 = seq_len - q_len;  // position of the chunk's first query
  const int64_t* table = a->block_table + req * a->max_blocks;
  const int64_t rows = (i1 - i0) * G;
  const int64_t rows_pad = (rows + 7) & ~(int64_t)7;
  // queries: prescaled fp32, or raw bf16 pairs (scale applied to the scores)
  for (int64_t r = 0; r < rows_pad; r++) {
    if (r >= rows) {
      if (PATH == 2)
        memset(s->qb + r * (d / 2), 0, sizeof(uint32_t) * (d / 2));
      else
        memset(s->qf + r * d, 0, sizeof(float) * d);
      continue;
    }
    const int64_t off = (q_start + i0 + r / G) * a->q_stride + (kh * G + r % G) * d;
    if (PATH == 2) {
      memcpy(s->qb + r * (d / 2), (const uint16_t*)a->q + off, sizeof(uint16_t) * d);
    } else {
      load_row(a->q, off, d, a->bf16, s->qf + r * d);
      for (int64_t x = 0; x < d; x++) s->qf[r * d + x] *= a->scale;
    }
    s->m[r] = -INFINITY;
    s->l[r] = 0.f;
  }
  for (int64_t r = rows; r < rows_pad; r++) {
    s->m[r] = -INFINITY;
    s->l[r] = 0.f;
  }
  memset(s->acc, 0, sizeof(float) * rows_pad * d);
  const int64_t first_q = pos0 + i0, last_q = pos0 + i1 - 1;
  const int64_t lo = a->window > 0 && first_q - a->window + 1 > 0 ? first_q - a->window + 1 : 0;
  const int64_t hi = last_q + 1;  // keys lo .. hi - 1
  for (int64_t t0 = lo; t0 < hi; t0 += KT) {
#ifdef PAGEDLM_PREFILL_BF16
    if (PATH == 2) {
      pack_bf16(a, table, kh, t0, hi, (uint32_t*)s->kt, (uint16_t*)s->vf, DV);
      qk_bf16(s->qb, (const uint32_t*)s->kt, s->p, rows_pad, a->scale, DV);
    }
#endif
#ifdef PAGEDLM_AVX512
    if (PATH == 1) {
      pack_f32_avx512(a, table, kh, t0, hi, s->kt, s->vf, DV);
      qk_f32_avx512(s->qf, s->kt, s->p, rows_pad, DV);
    }
#endif
    if (PATH == 0) {
      pack_f32(a, table, kh, t0, hi, s->kt, s->vf, s->acc + rows_pad * d);
      qk_f32(s->qf, s->kt, s->p, rows_pad, d);
    }
    for (int64_t r = 0; r < rows_pad; r++) {
      int64_t jlo = 0, jhi = -1;  // padded rows see nothing
      if (r < rows) {
        const int64_t qpos = first_q + r / G;
        const int64_t klo = a->window > 0 ? qpos - a->window + 1 : 0;
        jlo = klo > t0 ? klo - t0 : 0;
        jhi = qpos - t0 < KT - 1 ? qpos - t0 : KT - 1;
      }
#ifdef PAGEDLM_AVX512
      if (PATH != 0) {
        softmax_row_avx512(s, r, jlo, jhi);
        continue;
      }
#endif
      softmax_row(s, r, jlo, jhi);
    }
#ifdef PAGEDLM_PREFILL_BF16
    if (PATH == 2) pv_bf16(s, (const uint16_t*)s->vf, rows_pad, DV);
#endif
#ifdef PAGEDLM_AVX512
    if (PATH == 1) pv_f32_avx512(s, s->vf, rows_pad, DV);
#endif
    if (PATH == 0) pv_f32(s, s->vf, rows_pad, d);
  }
  for (int64_t r = 0; r < rows; r++) {
    float* acc = s->acc + r * d;
    const float inv = 1.f / s->l[r];  // l >= 1: every row sees its own position
    for (int64_t x = 0; x < d; x++) acc[x] *= inv;
    const int64_t token = q_start + i0 + r / G;
    store_row(a->out, (token * a->num_heads + kh * G + r % G) * d, d, a->bf16, acc);
  }
}

static void attend_item(const Args* a, Scratch* s, int path, int64_t req, int64_t kh, int64_t i0,
                        int64_t i1) {
#define TILE(P, DV) attend_tile(a, s, req, kh, i0, i1, P, DV)
#ifdef PAGEDLM_PREFILL_BF16
  const int64_t d = a->head_size;
  if (path == 2) {
    if (d == 64) TILE(2, 4);
    else if (d == 128) TILE(2, 8);
    else TILE(2, 16);
    return;
  }
#endif
#ifdef PAGEDLM_AVX512
  if (path == 1) {
    switch (a->head_size) {
      case 64: TILE(1, 4); return;
      case 128: TILE(1, 8); return;
      case 256: TILE(1, 16); return;
      case 32: TILE(1, 2); return;
      case 16: TILE(1, 1); return;
      default: break;
    }
  }
#endif
  TILE(0, 0);
#undef TILE
}

// Query rows [query_start_loc[r], query_start_loc[r + 1]) of request r attend positions
// 0 .. seq_lens[r] - 1 of its sequence. q rows are q_stride elements apart (heads contiguous);
// out is [rows, num_heads, head_size]. Returns 0, or -1 when scratch memory ran out.
int paged_prefill_attention(const void* q, int64_t q_stride, const void* k_cache,
                            const void* v_cache, const int64_t* block_table, int64_t max_blocks,
                            const int64_t* query_start_loc, const int64_t* seq_lens, void* out,
                            int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_size, int64_t block_size, float scale, int64_t window,
                            int bf16, int kind, float k_scale, float v_scale, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const Args a = {q,          k_cache,         v_cache,       block_table,
                  query_start_loc, seq_lens,   out,           max_blocks,
                  num_heads,  num_kv_heads,    head_size,     block_size,
                  window,     q_stride,        group,         num_kv_heads * head_size,
                  scale,      k_scale,         v_scale,       bf16,
                  kind};
  int path = 0;
#ifdef PAGEDLM_AVX512
  if (head_size % 16 == 0 && head_size <= 256 && (head_size & (head_size - 1)) == 0) path = 1;
#endif
#ifdef PAGEDLM_PREFILL_BF16
  if (bf16 && kind != KV_F32 && (head_size == 64 || head_size == 128 || head_size == 256))
    path = 2;
#endif
  // Query tokens per item: about 128 rows, fewer while there are too few items for the threads.
  int64_t tile = 128 / group > 1 ? 128 / group : 1;
  tile = tile > 64 ? 64 : tile;
  int64_t num_items = 0;
  for (;;) {
    num_items = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
      const int64_t n = query_start_loc[r + 1] - query_start_loc[r];
      num_items += (n + tile - 1) / tile * num_kv_heads;
    }
    if (tile == 1 || num_items >= 4 * num_threads) break;
    tile /= 2;
  }
  int64_t* first_item = malloc(sizeof(int64_t) * (num_reqs + 1));
  if (first_item == NULL) return -1;
  first_item[0] = 0;
  for (int64_t r = 0; r < num_reqs; r++) {
    const int64_t n = query_start_loc[r + 1] - query_start_loc[r];
    first_item[r + 1] = first_item[r] + (n + tile - 1) / tile * num_kv_heads;
  }
  const int64_t rows_cap = ((tile * group + 7) & ~(int64_t)7);
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch s;
    const int64_t d = head_size;
    s.rows_cap = rows_cap;
    // acc has one more row of slack: the portable packer's conversion row
    s.acc = malloc(sizeof(float) * (rows_cap + 1) * d);
    s.m = malloc(sizeof(float) * rows_cap);
    s.l = malloc(sizeof(float) * rows_cap);
    s.alpha = malloc(sizeof(float) * rows_cap);
    s.p = malloc(sizeof(float) * rows_cap * KT);
    s.pb = malloc(sizeof(uint32_t) * rows_cap * KT / 2);
    s.kt = malloc(sizeof(float) * d * KT);
    s.vf = malloc(sizeof(float) * d * KT);
    s.qf = malloc(sizeof(float) * rows_cap * d);
    s.qb = malloc(sizeof(uint32_t) * rows_cap * d / 2 + 4);
    const int ok = s.acc && s.m && s.l && s.alpha && s.p && s.pb && s.kt && s.vf && s.qf && s.qb;
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; it++) {
      if (!ok) continue;
      const int64_t item = num_items - 1 - it;  // the last tiles see the most keys: first
      int64_t lo = 0, hi = num_reqs;  // request: first_item[req] <= item < first_item[req + 1]
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (first_item[mid] <= item) lo = mid;
        else hi = mid;
      }
      const int64_t req = lo, local = item - first_item[req];
      const int64_t kh = local % num_kv_heads, t = local / num_kv_heads;
      const int64_t n = query_start_loc[req + 1] - query_start_loc[req];
      const int64_t i0 = t * tile, i1 = i0 + tile < n ? i0 + tile : n;
      attend_item(&a, &s, path, req, kh, i0, i1);
    }
    free(s.acc);
    free(s.m);
    free(s.l);
    free(s.alpha);
    free(s.p);
    free(s.pb);
    free(s.kt);
    free(s.vf);
    free(s.qf);
    free(s.qb);
  }
  free(first_item);
  return failed ? -1 : 0;
}
