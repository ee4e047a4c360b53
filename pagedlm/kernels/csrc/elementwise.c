// Row-wise kernels of the decoder layer: residual add + RMSNorm, SiLU(gate) * up, RoPE, and
// the paged KV cache write.
// Math runs in fp32; with bf16 tensors every intermediate that PyTorch (and Hugging Face) store
// in bf16 is rounded to bf16 at the same point, so results match the PyTorch path.
#include <stdlib.h>

#include "common.h"

#ifdef PAGEDLM_AVX512
// One row of rms_norm below on 16 lanes (hidden % 16 == 0), same roundings; `row` is scratch.
static void rms_norm_row512(const void* x, void* residual, const float* w, void* out,
                            int64_t offset_elems, int64_t hidden, float eps, float offset, int bf16,
                            float* row) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    __m512 v = load16(x, offset_elems + i, bf16);
    if (residual != NULL) {
      v = _mm512_add_ps(v, load16(residual, offset_elems + i, bf16));
      if (bf16) v = round512_bf16(v);
      store16(residual, offset_elems + i, v, bf16);
    }
    _mm512_storeu_ps(row + i, v);
    sum = _mm512_fmadd_ps(v, v, sum);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(sum) / (float)hidden + eps));
  for (int64_t i = 0; i < hidden; i += 16) {
    const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(row + i), inv);
    const __m512 wi = _mm512_loadu_ps(w + i);
    __m512 y;
    if (offset != 0.f)
      y = _mm512_mul_ps(normed, _mm512_add_ps(_mm512_set1_ps(offset), wi));
    else
      y = _mm512_mul_ps(wi, bf16 ? round512_bf16(normed) : normed);
    store16(out, offset_elems + i, y, bf16);
  }
}
#endif

// out = norm(x + residual) * w; `residual` (if not NULL) is overwritten with x + residual.
// offset 0: w * bf16(norm) (Llama); offset 1: norm * (1 + w) rounded once (Gemma).
// Returns 0 if a buffer could not be allocated (the output is then incomplete), else 1.
int rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows,
             int64_t hidden, float eps, float offset, int bf16, int num_threads) {
  int ok = 1;
#pragma omp parallel num_threads(num_threads)
  {
    float* row = malloc(sizeof(float) * hidden * 3);
    const int have = row != NULL;
    if (!have) {
#pragma omp atomic write
      ok = 0;
    }
    float* res = row + hidden;
    float* w = row + 2 * hidden;
    if (have) load_row(weight, 0, hidden, bf16, w);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      if (!have) continue;
#ifdef PAGEDLM_AVX512
      if (hidden % 16 == 0) {
        rms_norm_row512(x, residual, w, out, r * hidden, hidden, eps, offset, bf16, row);
        continue;
      }
#endif
      load_row(x, r * hidden, hidden, bf16, row);
      if (residual != NULL) {
        load_row(residual, r * hidden, hidden, bf16, res);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
          row[i] = bf16 ? round_bf16(row[i] + res[i]) : row[i] + res[i];
        store_row(residual, r * hidden, hidden, bf16, row);
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; i++) sum += row[i] * row[i];
      const float inv = 1.f / sqrtf(sum / (float)hidden + eps);
      if (offset != 0.f) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) row[i] = row[i] * inv * (offset + w[i]);
      } else if (bf16) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) row[i] = w[i] * round_bf16(row[i] * inv);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) row[i] = w[i] * (row[i] * inv);
      }
      store_row(out, r * hidden, hidden, bf16, row);
    }
    free(row);
  }
  return ok;
}

// x = [gate | up] per row ([rows, 2 * d]) -> out [rows, d] = bf16(silu(gate)) * up.
// Returns 0 if a buffer could not be allocated (the output is then incomplete), else 1.
int silu_and_mul(const void* x, void* out, int64_t rows, int64_t d, int bf16, int num_threads) {
  int ok = 1;
#pragma omp parallel num_threads(num_threads)
  {
    float* restrict gate = malloc(sizeof(float) * d * 2);
    const int have = gate != NULL;
    if (!have) {
#pragma omp atomic write
      ok = 0;
    }
    float* restrict up = gate + d;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      if (!have) continue;
      int64_t i = 0;
#ifdef PAGEDLM_AVX512
      for (; i + 16 <= d; i += 16) {
        const __m512 g = load16(x, r * 2 * d + i, bf16), u = load16(x, r * 2 * d + d + i, bf16);
        store16(out, r * d + i, silu_mul512(g, u, bf16), bf16);
      }
#endif
      const int64_t n = d - i;
      load_row(x, r * 2 * d + i, n, bf16, gate);
      load_row(x, r * 2 * d + d + i, n, bf16, up);
      for (int64_t j = 0; j < n; j++) {
        const float s = gate[j] / (1.f + exp_clamped(-gate[j]));
        gate[j] = (bf16 ? round_bf16(s) : s) * up[j];
      }
      store_row(out, r * d + i, n, bf16, gate);
    }
    free(gate);
  }
  return ok;
}

#ifdef PAGEDLM_AVX512
// -x on 16 lanes, as the scalar unary minus (-0 for +0: a sign flip, not 0 - x).
static inline __m512 neg(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}
#endif

// NeoX-style RoPE in place on the first `rotary_dim` dims of every head of q and k, whose rows
// are `q_stride` / `k_stride` elements apart. cos/sin: fp32 [max_position, rotary_dim]; with
// bf16 they are rounded to bf16 first and x*cos + rotate_half(x)*sin rounds after each op.
// Returns 0 if a buffer could not be allocated (the output is then incomplete), else 1.
int rotary_embedding(void* q, void* k, const int64_t* positions, const float* cos_cache,
                     const float* sin_cache, int64_t tokens, int64_t q_heads, int64_t k_heads,
                     int64_t q_stride, int64_t k_stride, int64_t head_size, int64_t rotary_dim,
                     int bf16, int num_threads) {
  const int64_t half = rotary_dim / 2;
  int ok = 1;
#pragma omp parallel num_threads(num_threads)
  {
    float* buf = malloc(sizeof(float) * rotary_dim * 4);
    const int have = buf != NULL;
    if (!have) {
#pragma omp atomic write
      ok = 0;
    }
    float* c = buf;
    float* s = buf + rotary_dim;
    float* x = buf + 2 * rotary_dim;
    float* y = buf + 3 * rotary_dim;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
      if (!have) continue;
      memcpy(c, cos_cache + positions[t] * rotary_dim, sizeof(float) * rotary_dim);
      memcpy(s, sin_cache + positions[t] * rotary_dim, sizeof(float) * rotary_dim);
      if (bf16) {
#pragma omp simd
        for (int64_t i = 0; i < rotary_dim; i++) {
          c[i] = round_bf16(c[i]);
          s[i] = round_bf16(s[i]);
        }
      }
      for (int64_t h = 0; h < q_heads + k_heads; h++) {
        void* base = h < q_heads ? q : k;
        const int64_t offset =
            h < q_heads ? t * q_stride + h * head_size : t * k_stride + (h - q_heads) * head_size;
#ifdef PAGEDLM_AVX512
        if (half % 16 == 0) {  // the loops below, 16 lanes at a time, rounded alike (but
          // for fp32 denormal products, which the bf16 conversion flushes to zero)
          for (int64_t i = 0; i < half; i += 16) {
            const __m512 x1 = load16(base, offset + i, bf16);
            const __m512 x2 = load16(base, offset + half + i, bf16);
            const __m512 c1 = _mm512_loadu_ps(c + i), c2 = _mm512_loadu_ps(c + half + i);
            const __m512 s1 = _mm512_loadu_ps(s + i), s2 = _mm512_loadu_ps(s + half + i);
            __m512 a = _mm512_mul_ps(x1, c1), b = _mm512_mul_ps(neg(x2), s1);
            __m512 e = _mm512_mul_ps(x2, c2), f = _mm512_mul_ps(x1, s2);
            if (bf16) {
              a = round512_bf16(a), b = round512_bf16(b), e = round512_bf16(e);
              f = round512_bf16(f);
            }
            store16(base, offset + i, _mm512_add_ps(a, b), bf16);
            store16(base, offset + half + i, _mm512_add_ps(e, f), bf16);
          }
          continue;
        }
#endif
        load_row(base, offset, rotary_dim, bf16, x);
        if (bf16) {
#pragma omp simd
          for (int64_t i = 0; i < half; i++) {
            y[i] = round_bf16(round_bf16(x[i] * c[i]) + round_bf16(-x[i + half] * s[i]));
            y[i + half] =
                round_bf16(round_bf16(x[i + half] * c[i + half]) + round_bf16(x[i] * s[i + half]));
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < half; i++) {
            y[i] = x[i] * c[i] - x[i + half] * s[i];
            y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
          }
        }
        store_row(base, offset, rotary_dim, bf16, y);
      }
    }
    free(buf);
  }
  return ok;
}

// The paged cache write of a step's new tokens (vLLM's reshape_and_cache): row i of key and
// value (row_bytes contiguous bytes each, rows key_stride / value_stride bytes apart) to row
// slots[i] of k_cache / v_cache (row_bytes apart). Returns the number of slots outside
// 0 .. num_slots - 1; nothing is written then.
int64_t reshape_and_cache(const void* key, const void* value, int64_t key_stride,
                          int64_t value_stride, void* k_cache, void* v_cache,
                          const int64_t* slots, int64_t tokens, int64_t row_bytes,
                          int64_t num_slots, int num_threads) {
  int64_t bad = 0;
  for (int64_t i = 0; i < tokens; i++) bad += slots[i] < 0 || slots[i] >= num_slots;
  if (bad) return bad;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= 64)
  for (int64_t i = 0; i < tokens; i++) {
    memcpy((char*)k_cache + slots[i] * row_bytes, (const char*)key + i * key_stride, row_bytes);
    memcpy((char*)v_cache + slots[i] * row_bytes, (const char*)value + i * value_stride,
           row_bytes);
  }
  return 0;
}
