// Paged attention for decode rows (one query token per sequence), bf16 or fp32 caches.
//
// KV cache layout: [num_blocks, block_size, num_kv_heads, head_size] per K and V.
// Work is split over (sequence, kv head) pairs with OpenMP; each pair computes the scores of
// its group of query heads against every cached token (read once through the block table),
// then a softmax in fp32 and the weighted sum of values. No copy of the cache is made.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load(const void* base, int64_t i, int bf16) {
  if (!bf16) return ((const float*)base)[i];
  uint32_t u = ((uint32_t)((const uint16_t*)base)[i]) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Convert one cache row to fp32 (the branch is outside the vectorized loops).
static inline void load_row(const void* base, int64_t offset, int64_t n, int bf16,
                            float* restrict row) {
  if (bf16) {
    const uint16_t* restrict src = (const uint16_t*)base + offset;
    uint32_t* restrict dst = (uint32_t*)row;
#pragma omp simd
    for (int64_t d = 0; d < n; d++) dst[d] = ((uint32_t)src[d]) << 16;
  } else {
    memcpy(row, (const float*)base + offset, sizeof(float) * n);
  }
}

static inline void store(void* base, int64_t i, float f, int bf16) {
  if (!bf16) {
    ((float*)base)[i] = f;
    return;
  }
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  ((uint16_t*)base)[i] = (uint16_t)(u >> 16);
}

void paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                            const int64_t* block_table, int64_t max_blocks,
                            const int64_t* seq_lens, void* out, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                            int64_t block_size, float scale, int64_t window, int bf16,
                            int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
  for (int64_t b = 0; b < num_seqs; b++) {
    for (int64_t kh = 0; kh < num_kv_heads; kh++) {
      const int64_t len = seq_lens[b];
      const int64_t start = (window > 0 && len > window) ? len - window : 0;
      const int64_t n = len - start;
      float* qf = malloc(sizeof(float) * group * head_size);
      float* acc = calloc(group * head_size, sizeof(float));
      float* scores = malloc(sizeof(float) * group * (n > 0 ? n : 1));
      float* row = malloc(sizeof(float) * head_size);
      float* kt = malloc(sizeof(float) * head_size * 16);
      for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_size; d++)
          qf[g * head_size + d] = load(q, (b * num_heads + kh * group + g) * head_size + d, bf16) * scale;
      // Scores, 16 tokens at a time: K rows are transposed into kt[d][16] so that each query
      // element multiplies a whole vector of 16 tokens.
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t m = n - t0 < 16 ? n - t0 : 16;
        for (int64_t j = 0; j < m; j++) {
          const int64_t pos = start + t0 + j;
          const int64_t blk = block_table[b * max_blocks + pos / block_size];
          const int64_t base =
              ((blk * block_size + pos % block_size) * num_kv_heads + kh) * head_size;
          load_row(k_cache, base, head_size, bf16, row);
          for (int64_t d = 0; d < head_size; d++) kt[d * 16 + j] = row[d];
        }
        for (int64_t j = m; j < 16; j++)
          for (int64_t d = 0; d < head_size; d++) kt[d * 16 + j] = 0.f;
        for (int64_t g = 0; g < group; g++) {
          float s16[16] = {0};
          const float* restrict qg = qf + g * head_size;
          for (int64_t d = 0; d < head_size; d++) {
            const float qd = qg[d];
#pragma omp simd
            for (int64_t j = 0; j < 16; j++) s16[j] += qd * kt[d * 16 + j];
          }
          for (int64_t j = 0; j < m; j++) scores[g * n + t0 + j] = s16[j];
        }
      }
      for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * n;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
        for (int64_t t = 0; t < n; t++) {
          sg[t] = expf(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t t = 0; t < n; t++) sg[t] *= inv;
      }
      for (int64_t t = 0; t < n; t++) {
        const int64_t pos = start + t;
        const int64_t blk = block_table[b * max_blocks + pos / block_size];
        const int64_t base = ((blk * block_size + pos % block_size) * num_kv_heads + kh) * head_size;
        load_row(v_cache, base, head_size, bf16, row);
        for (int64_t g = 0; g < group; g++) {
          const float p = scores[g * n + t];
          float* restrict ag = acc + g * head_size;
#pragma omp simd
          for (int64_t d = 0; d < head_size; d++) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_size; d++)
          store(out, (b * num_heads + kh * group + g) * head_size + d, acc[g * head_size + d], bf16);
      free(qf);
      free(acc);
      free(scores);
      free(row);
      free(kt);
    }
  }
}
