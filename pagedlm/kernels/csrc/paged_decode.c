// Paged attention for decode rows (one query token per sequence), bf16 or fp32 caches.
//
// KV cache layout: [num_blocks, block_size, num_kv_heads, head_size] per K and V.
// Work is split over (sequence, kv head) pairs with OpenMP; each pair reads its keys and values
// once through the block table (no copy of the cache), scores them against its group of query
// heads and takes a softmax, all in fp32. Scratch buffers are per thread. Head sizes 64, 128
// and 256 take an AVX-512 path where the compiler targets it; every size has the portable one.
#include <stdlib.h>

#include "common.h"

// One (sequence, kv head) pair, portable C that gcc vectorizes; inlined with constant head
// sizes so the loops unroll.
static inline __attribute__((always_inline)) void attend(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* table, int64_t len,
    void* out, int64_t b, int64_t kh, int64_t num_heads, int64_t group, const int64_t head_size,
    int64_t token_stride, int64_t block_size, float scale, int64_t window, int bf16, float* qf,
    float* acc, float* scores, float* row) {
  const int64_t start = (window > 0 && len > window) ? len - window : 0;
  const int64_t n = len - start;
  const int64_t head_offset = kh * head_size;
  for (int64_t g = 0; g < group; g++) {
    float* qg = qf + g * head_size;
    load_row(q, (b * num_heads + kh * group + g) * head_size, head_size, bf16, qg);
#pragma omp simd
    for (int64_t d = 0; d < head_size; d++) qg[d] *= scale;
  }
  for (int64_t t = 0; t < n; t++) {
    const int64_t pos = start + t;
    const int64_t base = (table[pos / block_size] * block_size + pos % block_size) * token_stride;
    load_row(k_cache, base + head_offset, head_size, bf16, row);
    for (int64_t g = 0; g < group; g++) {
      const float* restrict qg = qf + g * head_size;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_size; d++) s += qg[d] * row[d];
      scores[g * n + t] = s;
    }
  }
  for (int64_t g = 0; g < group; g++) {
    float* restrict sg = scores + g * n;
    float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
      sg[t] = exp_clamped(sg[t] - mx);
      sum += sg[t];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) sg[t] *= inv;
  }
  memset(acc, 0, sizeof(float) * group * head_size);
  for (int64_t t = 0; t < n; t++) {
    const int64_t pos = start + t;
    const int64_t base = (table[pos / block_size] * block_size + pos % block_size) * token_stride;
    load_row(v_cache, base + head_offset, head_size, bf16, row);
    for (int64_t g = 0; g < group; g++) {
      const float p = scores[g * n + t];
      float* restrict ag = acc + g * head_size;
#pragma omp simd
      for (int64_t d = 0; d < head_size; d++) ag[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; g++)
    store_row(out, (b * num_heads + kh * group + g) * head_size, head_size, bf16,
              acc + g * head_size);
}

#ifdef PAGEDLM_AVX512
// The pair (sequence, kv head) with head_size = 16 * DV; DV is a constant after inlining, so
// the key/value row and the accumulators live in registers.
static inline __attribute__((always_inline)) void attend_avx512(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* table, int64_t len,
    void* out, int64_t b, int64_t kh, int64_t num_heads, int64_t group, const int DV,
    int64_t token_stride, int64_t block_size, float scale, int64_t window, int bf16, float* qf,
    float* scores, float* row) {
  const int64_t head_size = 16 * DV;
  const int64_t start = (window > 0 && len > window) ? len - window : 0;
  const int64_t n = len - start;
  const int64_t head_offset = kh * head_size;
  for (int64_t g = 0; g < group; g++) {
    const int64_t q_offset = (b * num_heads + kh * group + g) * head_size;
    for (int c = 0; c < DV; c++) {
      const __m512 qv = load16(q, q_offset + 16 * c, bf16);
      _mm512_storeu_ps(qf + g * head_size + 16 * c, _mm512_mul_ps(qv, _mm512_set1_ps(scale)));
    }
  }
  for (int64_t t = 0; t < n; t++) {
    const int64_t pos = start + t;
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    const int64_t base = slot * token_stride + head_offset;
    __m512 k[16];
    for (int c = 0; c < DV; c++) k[c] = load16(k_cache, base + 16 * c, bf16);
    for (int64_t g = 0; g < group; g++) {
      const float* qg = qf + g * head_size;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
      for (int c = 1; c < DV; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], a);
      scores[g * n + t] = _mm512_reduce_add_ps(a);
    }
  }
  for (int64_t g = 0; g < group; g++) {
    float* sg = scores + g * n;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
    float m = _mm512_reduce_max_ps(mx);
    for (int64_t i = t; i < n; i++) m = sg[i] > m ? sg[i] : m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= n; t += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mv));
      _mm512_storeu_ps(sg + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (t < n) {
      const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + t), mv));
      _mm512_mask_storeu_ps(sg + t, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    const float total = _mm512_reduce_add_ps(sum);
    const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);
    for (t = 0; t + 16 <= n; t += 16)
      _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), inv));
    for (; t < n; t++) sg[t] *= _mm512_cvtss_f32(inv);
  }
  // Values: heads in passes of 16 / DV so that the accumulators fit in 16 registers.
  const int64_t per_pass = DV >= 16 ? 1 : 16 / DV;
  for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
    const int64_t gn = group - g0 < per_pass ? group - g0 : per_pass;
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
      const int64_t pos = start + t;
      const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
      const int64_t base = slot * token_stride + head_offset;
      __m512 v[16];
      for (int c = 0; c < DV; c++) v[c] = load16(v_cache, base + 16 * c, bf16);
      for (int64_t gi = 0; gi < gn; gi++) {
        const __m512 p = _mm512_set1_ps(scores[(g0 + gi) * n + t]);
        for (int c = 0; c < DV; c++) acc[gi * DV + c] = _mm512_fmadd_ps(p, v[c], acc[gi * DV + c]);
      }
    }
    for (int64_t gi = 0; gi < gn; gi++) {
      for (int c = 0; c < DV; c++) _mm512_storeu_ps(row + 16 * c, acc[gi * DV + c]);
      store_row(out, (b * num_heads + kh * group + g0 + gi) * head_size, head_size, bf16, row);
    }
  }
}
#endif

void paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                            const int64_t* block_table, int64_t max_blocks,
                            const int64_t* seq_lens, void* out, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                            int64_t block_size, float scale, int64_t window, int bf16,
                            int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_size;
  int64_t max_len = 1;
  for (int64_t b = 0; b < num_seqs; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
#pragma omp parallel num_threads(num_threads)
  {
    float* qf = malloc(sizeof(float) * group * head_size);
    float* acc = malloc(sizeof(float) * group * head_size);
    float* scores = malloc(sizeof(float) * group * max_len);
    float* row = malloc(sizeof(float) * head_size);
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < num_seqs; b++) {
      for (int64_t kh = 0; kh < num_kv_heads; kh++) {
        const int64_t* table = block_table + b * max_blocks;
#define ATTEND(D)                                                                              \
  attend(q, k_cache, v_cache, table, seq_lens[b], out, b, kh, num_heads, group, D, token_stride, \
         block_size, scale, window, bf16, qf, acc, scores, row)
#define ATTEND_AVX512(DV)                                                                    \
  attend_avx512(q, k_cache, v_cache, table, seq_lens[b], out, b, kh, num_heads, group, DV,     \
                token_stride, block_size, scale, window, bf16, qf, scores, row)
        switch (head_size) {
#ifdef PAGEDLM_AVX512
          case 64: ATTEND_AVX512(4); break;
          case 128: ATTEND_AVX512(8); break;
          case 256: ATTEND_AVX512(16); break;
#endif
          default: ATTEND(head_size);
        }
#undef ATTEND
#undef ATTEND_AVX512
      }
    }
    free(qf);
    free(acc);
    free(scores);
    free(row);
  }
}
