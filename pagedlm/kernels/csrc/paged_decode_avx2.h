// The decode path of paged_decode.c for AVX2 (no AVX-512): one (sequence, kv head, split)
// item, fp32 or bf16 caches, head sizes that are multiples of 8. The portable loop reduces
// every (key, head) dot product horizontally and takes its exps one at a time; here eight keys
// are scored at once (eight accumulators, one transposing reduction), the softmax runs on 8
// lanes, and each head's weighted values stay in registers, 64 dimensions per pass.
// Same operations as the portable path, summed in another order (fp32 rounding differs).
#pragma once
#include "paged_decode_avx512.h"  // KV, store_head

#if defined(__AVX2__) && defined(__FMA__) && !defined(PAGEDLM_AVX512)
#define PAGEDLM_DECODE_AVX2 1

static inline __attribute__((always_inline)) __m256 load8_kv(const void* base, int64_t offset,
                                                            const int BF16) {
  if (BF16) {
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + offset));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps((const float*)base + offset);
}

// exp_clamped on 8 lanes, the same polynomial.
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// Lane j = the sum of v[j]'s lanes.
static inline __m256 sum_lanes8(const __m256 v[8]) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline __attribute__((always_inline)) float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline __attribute__((always_inline)) float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The cache row of the position at (*blk, *off) in the block table, then the next position:
// keys are walked block by block, with no division per key.
static inline __attribute__((always_inline)) int64_t next_row(const int64_t* table,
                                                              int64_t block_size, int64_t* blk,
                                                              int64_t* off) {
  const int64_t row = table[*blk] * block_size + *off;
  if (++*off == block_size) {
    *off = 0;
    ++*blk;
  }
  return row;
}

// Scores of keys [start, end) (head-major, rows of n), softmax, weighted values: as `attend`.
static inline __attribute__((always_inline)) void attend_avx2(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* table, int64_t start,
    int64_t end, void* out, int64_t b, int64_t kh, int64_t num_heads, int64_t group,
    int64_t head_size, int64_t token_stride, int64_t block_size, float scale, int bf16,
    const int BF16, float* part, float* lse, float* qf, float* acc, float* scores) {
  const int64_t n = end - start, D = head_size, head_offset = kh * head_size;
  for (int64_t g = 0; g < group; g++) {
    float* qg = qf + g * D;
    load_row(q, (b * num_heads + kh * group + g) * D, D, bf16, qg);
    for (int64_t d = 0; d < D; d++) qg[d] *= scale;
  }
  int64_t blk = start / block_size, off = start % block_size;
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int nk = n - t0 < 8 ? (int)(n - t0) : 8;
    int64_t base[8];
    for (int j = 0; j < nk; j++)
      base[j] = next_row(table, block_size, &blk, &off) * token_stride + head_offset;
    for (int64_t g = 0; g < group; g++) {
      const float* qg = qf + g * D;
      __m256 s[8];
      for (int j = 0; j < 8; j++) s[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int j = 0; j < nk; j++)
          s[j] = _mm256_fmadd_ps(qv, load8_kv(k_cache, base[j] + d, BF16), s[j]);
      }
      if (nk == 8) {
        _mm256_storeu_ps(scores + g * n + t0, sum_lanes8(s));
      } else {
        float sums[8];
        _mm256_storeu_ps(sums, sum_lanes8(s));
        for (int j = 0; j < nk; j++) scores[g * n + t0 + j] = sums[j];
      }
    }
  }
  for (int64_t g = 0; g < group; g++) {
    float* sg = scores + g * n;
    int64_t t = 0;
    __m256 vmx = _mm256_set1_ps(-INFINITY), vsum = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sg + t));
    float mx = max_lanes(vmx);
    for (; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
    const __m256 m8 = _mm256_set1_ps(mx);
    for (t = 0; t + 8 <= n; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m8));
      _mm256_storeu_ps(sg + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = sum_lanes(vsum);
    for (; t < n; t++) {
      sg[t] = exp_clamped(sg[t] - mx);
      sum += sg[t];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (t = 0; t < n; t++) sg[t] *= inv;
    if (lse != NULL) lse[g] = mx + logf(sum);
  }
  for (int64_t g = 0; g < group; g++) {
    const float* sg = scores + g * n;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int chunks = D - d0 < 64 ? (int)((D - d0) / 8) : 8;
      __m256 a[8];
      for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
      int64_t vb = start / block_size, vo = start % block_size;
      for (int64_t t = 0; t < n; t++) {
        const int64_t at =
            next_row(table, block_size, &vb, &vo) * token_stride + head_offset + d0;
        const __m256 p = _mm256_set1_ps(sg[t]);
        for (int c = 0; c < chunks; c++)
          a[c] = _mm256_fmadd_ps(p, load8_kv(v_cache, at + 8 * c, BF16), a[c]);
      }
      for (int c = 0; c < chunks; c++) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, a[c]);
    }
  }
  for (int64_t g = 0; g < group; g++)
    store_head(out, part, b, kh * group + g, g, num_heads, D, bf16, acc + g * D);
}
#endif
