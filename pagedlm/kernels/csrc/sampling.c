// Greedy sampling: the first index of each row's maximum, for bf16 or fp32 logits.
// Two passes per row: a vectorized max, then a scan for the first element equal to it
// (rows holding NaN return the first NaN, as torch.argmax does).
#include "common.h"

void argmax_rows(const void* logits, int64_t num_rows, int64_t vocab, int bf16,
                 int64_t* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t r = 0; r < num_rows; r++) {
    float row[1024];
    float mx = -INFINITY;
    int has_nan = 0;
    for (int64_t c0 = 0; c0 < vocab; c0 += 1024) {
      const int64_t n = vocab - c0 < 1024 ? vocab - c0 : 1024;
      load_row(logits, r * vocab + c0, n, bf16, row);
#pragma omp simd reduction(max : mx) reduction(| : has_nan)
      for (int64_t i = 0; i < n; i++) {
        mx = row[i] > mx ? row[i] : mx;
        has_nan |= row[i] != row[i];
      }
    }
    int64_t best = 0;
    for (int64_t c0 = 0; c0 < vocab; c0 += 1024) {
      const int64_t n = vocab - c0 < 1024 ? vocab - c0 : 1024;
      load_row(logits, r * vocab + c0, n, bf16, row);
      int64_t found = -1;
      for (int64_t i = 0; i < n; i++) {
        if (has_nan ? row[i] != row[i] : row[i] == mx) {
          found = i;
          break;
        }
      }
      if (found >= 0) {
        best = c0 + found;
        break;
      }
    }
    out[r] = best;
  }
}

// ---------------------------------------------------------------- random rows
// The exponential race argmax(p / E), E ~ Exp(1), p = softmax(logits[r] * scale[r]), as its
// Gumbel-max form: the first index of the max over j of logits[r][j] * scale[r] - log(E),
// E = -log(U) (scale: 1 / temperature, or NULL for 1). U comes from a counter hash of (seed,
// r, j) (SplitMix64: two 23-bit uniforms per 64-bit output, (k + 0.5) / 2^23, exact in fp32,
// so never 0 or 1: 24 bits would round the top one to 1, E to 0, and its token would win),
// so a row's draw depends on the seed, its index and its logits only, and any thread order
// gives the same tokens. -inf (and NaN) logits never win; a row with no finite logit gets 0.
// The AVX-512 path computes the logs by a polynomial (~1e-7 relative), the portable one by
// logf: the two differ only where two candidates tie to within that.

#define GOLDEN_GAMMA 0x9E3779B97F4A7C15ull
#define MIX64_M1 0xBF58476D1CE4E5B9ull  // SplitMix64's finalizer multipliers
#define MIX64_M2 0x94D049BB133111EBull

#if defined(PAGEDLM_AVX512) && defined(__AVX512DQ__)
#define PAGEDLM_GUMBEL_AVX512 1  // 64-bit lane products (AVX-512 DQ) for the hash
#endif

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * MIX64_M1;
  z = (z ^ (z >> 27)) * MIX64_M2;
  return z ^ (z >> 31);
}

// U of element j of the row whose key is `key`: the low (even j) or high (odd j) 32 bits of
// mix64(key + (j / 2 + 1) * GOLDEN_GAMMA), top 23 bits.
static inline float uniform_at(uint64_t key, int64_t j) {
  const uint64_t z = mix64(key + (uint64_t)(j / 2 + 1) * GOLDEN_GAMMA);
  const uint32_t half = j % 2 ? (uint32_t)(z >> 32) : (uint32_t)z;
  return ((float)(half >> 9) + 0.5f) * 0x1p-23f;
}

#ifdef PAGEDLM_GUMBEL_AVX512
// log(x) for positive normal x: x = m 2^k, m in [sqrt(1/2), sqrt(2)), and Cephes' logf
// polynomial in m - 1.
static inline __m512 log_512(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
  __m512 k = _mm512_getexp_ps(x);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  k = _mm512_mask_add_ps(k, big, k, _mm512_set1_ps(1.f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.f));
  __m512 y = _mm512_set1_ps(7.0376836292e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.1514610310e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.1676998740e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.2420140846e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.4249322787e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.6668057665e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.0000714765e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-2.4999993993e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(3.3333331174e-1f));
  const __m512 f2 = _mm512_mul_ps(f, f);
  y = _mm512_mul_ps(y, _mm512_mul_ps(f2, f));                    // f^3 P(f)
  y = _mm512_fmadd_ps(f2, _mm512_set1_ps(-0.5f), y);              // - f^2 / 2
  return _mm512_fmadd_ps(k, _mm512_set1_ps(0.693147180559945f), _mm512_add_ps(f, y));
}

static inline __m512i mix64_512(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                         _mm512_set1_epi64((long long)MIX64_M1));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                         _mm512_set1_epi64((long long)MIX64_M2));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}
#endif

// 1 where the vector path is built; elsewhere each value costs a scalar hash and two logf
// calls, slower than torch's uniform_ and log, which the sampler then uses instead.
int gumbel_argmax_vectorized(void) {
#ifdef PAGEDLM_GUMBEL_AVX512
  return 1;
#else
  return 0;
#endif
}

void gumbel_argmax_rows(const void* logits, int64_t num_rows, int64_t vocab, int bf16,
                        const float* scale, uint64_t seed, int64_t* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t r = 0; r < num_rows; r++) {
    const float sc = scale != NULL ? scale[r] : 1.f;
    const uint64_t key = mix64(seed + (uint64_t)(r + 1) * GOLDEN_GAMMA);
    float best = -INFINITY;
    int64_t best_j = 0, j = 0;
#ifdef PAGEDLM_GUMBEL_AVX512
    // lane l of 8 64-bit counters: element pair j / 2 + l; as 16 32-bit lanes they are the
    // uniforms of elements j .. j + 15 in order (low half first)
    __m512 vbest = _mm512_set1_ps(-INFINITY);
    __m512i vidx = _mm512_setzero_si512();
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi64((long long)(8 * GOLDEN_GAMMA));
    __m512i ctr = _mm512_add_epi64(
        _mm512_set1_epi64((long long)key),
        _mm512_mullo_epi64(_mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8),
                           _mm512_set1_epi64((long long)GOLDEN_GAMMA)));
    for (; j + 16 <= vocab; j += 16) {
      const __m512i bits = _mm512_srli_epi32(mix64_512(ctr), 9);
      ctr = _mm512_add_epi64(ctr, step);
      const __m512 u = _mm512_fmadd_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(0x1p-23f),
                                       _mm512_set1_ps(0x1p-24f));
      const __m512 e = _mm512_sub_ps(_mm512_setzero_ps(), log_512(u));  // Exp(1), > 0
      const __m512 l = _mm512_mul_ps(load16(logits, r * vocab + j, bf16), _mm512_set1_ps(sc));
      const __m512 v = _mm512_sub_ps(l, log_512(e));
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);  // first max per lane
      vbest = _mm512_mask_mov_ps(vbest, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, _mm512_add_epi32(lane, _mm512_set1_epi32((int)j)));
    }
    float vb[16];
    int32_t vi[16];
    _mm512_storeu_ps(vb, vbest);
    _mm512_storeu_si512(vi, vidx);
    for (int l = 0; l < 16; l++)
      if (vb[l] > best || (vb[l] == best && vb[l] > -INFINITY && vi[l] < best_j))
        best = vb[l], best_j = vi[l];
#endif
    for (; j < vocab; j++) {
      float l;
      load_row(logits, r * vocab + j, 1, bf16, &l);
      const float v = l * sc - logf(-logf(uniform_at(key, j)));
      if (v > best) best = v, best_j = j;
    }
    out[r] = best_j;
  }
}
