// Inner paths of paged_prefill.c: the work item's arguments and scratch, per tile of KT keys
// the packing of keys/values, and per block of RB_ROWS rows their scores, online-softmax update
// and weighted values, in portable C and AVX-512 fp32 (AVX-512 BF16: paged_prefill_bf16.h).
#pragma once
#include "common.h"

#define KT 256  // keys per tile: the per-row work of the online softmax and the accumulators'
               // loads and stores are paid once per 256 keys (128: 2-5% slower)
// Row pitches one cache line past a power of two: rows 1 KiB apart put an AMX tile's 16 rows
// in 4 of L1's 64 sets (score products at head size 64, in a harness: 34 -> 27 cycles each;
// one layer of a 4096-token prompt 22-25 -> 21 ms at 14/2 x 64, 28-32 -> 25 at 12/2 x 128).
#define KP (KT + 16)   // in 4-byte units: the scores, and the bf16 paths' packed keys
#define PBP (KT + 32)  // in bf16: the bf16 paths' probabilities
#define RB_ROWS 8  // rows whose scores, softmax and P.V are computed together (in L1)
#define RB_AMX 32  // the same on the AMX path: two tiles' rows, so each key or value tile loaded
                   // serves two tile products (paged_prefill_amx.h)
#define MAX_SLACK 8.f  // AVX-512 paths: a row's reference max (base 2) moves only when a score
                       // exceeds it by more than this, so probabilities stay <= 2^8

typedef struct {
  const void *q, *k_cache, *v_cache;
  const int64_t *block_table, *query_start_loc, *seq_lens;
  void* out;
  int64_t max_blocks, num_heads, num_kv_heads, head_size, block_size, window, q_stride;
  int64_t group, token_stride;
  float scale, k_scale, v_scale;
  int bf16, kind;  // queries / out in bf16; the cache's element kind (KV_*)
} Args;

// Per row: acc (head_size fp32), m (the running or reference max), l (the running sum; the
// AVX-512 paths keep 16 per-lane partial sums, reduced at the end), alpha (the factor of acc
// for the current tile). p / pb: one row block's scores or probabilities (fp32 / bf16 pairs).
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
    memcpy(p + r * KP, s, sizeof s);
  }
}

// Online softmax update of row r over the tile's valid lanes jlo..jhi (scores in pr, scaled);
// leaves the probabilities in pr (0 outside) and the accumulator's rescale factor in alpha[r].
static inline void softmax_row(Scratch* s, float* pr, int64_t r, int64_t jlo, int64_t jhi) {
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
  s->l[16 * r] = s->l[16 * r] * s->alpha[r] + sum;  // one lane of the row's 16
  s->m[r] = m_new;
}

// Rows r0 .. r0 + RB_ROWS - 1 (probabilities in p): acc = acc * alpha + p . V.
static void pv_f32(Scratch* s, const float* vf, int64_t r0, int64_t d) {
  for (int64_t r = r0; r < r0 + RB_ROWS; r++) {
    float* restrict acc = s->acc + r * d;
    const float al = s->alpha[r];
    const float* pr = s->p + (r - r0) * KP;
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

// Scores of 8 rows at a time (a row block; padded rows have zero queries).
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
      for (int i = 0; i < 8; i++) _mm512_storeu_ps(p + (r0 + i) * KP + kg, s[i]);
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

// The lane-wise max of a row's tile over the lanes jlo..jhi of pr (-inf elsewhere).
static inline __m512 tile_max512(const float* pr, int64_t jlo, int64_t jhi, int kn) {
  const int whole = jlo == 0 && jhi >= kn - 1;  // most tiles: no lane masked
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int kg = 0; kg < kn; kg += 16) {
    const __mmask16 lanes = whole ? 0xFFFF : lane_mask(kg, jlo, jhi);
    mx = _mm512_mask_max_ps(mx, lanes, mx, _mm512_loadu_ps(pr + kg));
  }
  return mx;
}

// Moves row r's reference max up to m_new: alpha[r] = 2^(m - m_new) (0 on the row's first
// tile, m = -inf) rescales its accumulator in the P.V; returns its lane sums rescaled.
static inline __m512 raise_max(Scratch* s, int64_t r, float m_new, __m512 sum) {
  s->alpha[r] = exp2f(s->m[r] - m_new);
  s->m[r] = m_new;
  return _mm512_mul_ps(sum, _mm512_set1_ps(s->alpha[r]));
}

// Online softmax update of row r over the lanes jlo..jhi of its scores pr (base 2; other lanes
// masked off, garbage allowed), with a lazy reference max: m[r] changes (and the row's acc and
// partial sums are rescaled by alpha[r] = 2^(m_old - m_new)) only when a score exceeds it by
// more than MAX_SLACK, else alpha[r] = 1. The probabilities replace the scores in pr; l[r]
// keeps 16 per-lane partial sums.
static inline void softmax_row_avx512(Scratch* s, float* pr, int64_t r, int64_t jlo, int64_t jhi,
                                      int kn) {
  s->alpha[r] = 1.f;
  if (jlo > jhi) {
    for (int kg = 0; kg < kn; kg += 16) _mm512_storeu_ps(pr + kg, _mm512_setzero_ps());
    return;
  }
  const int whole = jlo == 0 && jhi >= kn - 1;  // most tiles: no lane masked
  const __m512 mx = tile_max512(pr, jlo, jhi, kn);
  float* lr = s->l + 16 * r;
  __m512 sum = _mm512_loadu_ps(lr);
  if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(s->m[r] + MAX_SLACK), _CMP_GT_OQ))
    sum = raise_max(s, r, _mm512_reduce_max_ps(mx), sum);
  const __m512 vm = _mm512_set1_ps(s->m[r]);
  for (int kg = 0; kg < kn; kg += 16) {
    const __mmask16 lanes = whole ? 0xFFFF : lane_mask(kg, jlo, jhi);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp2_512(_mm512_sub_ps(_mm512_loadu_ps(pr + kg), vm)));
    _mm512_storeu_ps(pr + kg, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(lr, sum);
}

// Loads acc of row r, times alpha[r] unless it is 1 (the common case).
static inline __attribute__((always_inline)) __m512 load_acc(const Scratch* s, int64_t r,
                                                             int64_t d, int c) {
  const __m512 acc = _mm512_loadu_ps(s->acc + r * d + 16 * c);
  return s->alpha[r] == 1.f ? acc : _mm512_mul_ps(acc, _mm512_set1_ps(s->alpha[r]));
}

// Rows rb .. rb + RB_ROWS - 1 (probabilities in p): acc = acc * alpha + p . V, two rows at a
// time where the accumulators fit.
static inline __attribute__((always_inline)) void pv_f32_avx512(Scratch* s, const float* vf,
                                                                int64_t rb, const int DV,
                                                                int kn) {
  const int64_t d = 16 * DV;
  const int RB = DV <= 8 ? 2 : 1;
  for (int64_t r0 = rb; r0 < rb + RB_ROWS; r0 += RB) {
    __m512 acc[2][16];
    for (int i = 0; i < RB; i++)
      for (int c = 0; c < DV; c++) acc[i][c] = load_acc(s, r0 + i, d, c);
    for (int j = 0; j < kn; j++) {
      __m512 pj[2];
      for (int i = 0; i < RB; i++) pj[i] = _mm512_set1_ps(s->p[(r0 - rb + i) * KP + j]);
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
