// y[M, N] = x[M, K] . W[N, K]^T (+ bias) on AMX-INT8, for int8 weights with one scale per
// output channel: the 8-bit tiles of gguf_pack.py (pack_q8), q + 128 as unsigned bytes, whose
// 64-byte k-quad vectors are, 16 at a time, exactly the B tiles of TDPBSUD (row j: 4 values of
// each of 16 columns). Prefill chunks and large decode batches of quantization="int8" and
// compressed-tensors W8A8 layers.
//
// 1. Every row of x is quantized to int8 per QB-value block (the caller's: 128; QB = K, per
//    token as vLLM's W8A8, is 10-25% faster but costs +0.8% perplexity on the default model):
//    as[m][b] = amax / 127, and corr[m][b] = 128 * (the block's sum of quants) undoes the +128
//    of the weights.
// 2. Rows are taken in blocks of ACT_BLOCK_BYTES of quantized activations (each thread's L2
//    keeps them while the whole weight streams past); threads split a block's pairs of weight
//    tiles (32 output columns) and run its 32-row groups against them: per activation block,
//    four int32 C tiles accumulate its QB values (exact), and fp32 sums take
//    as[m][b] * (C - corr[m][b]); then y = ws[n] * sum (+ bias[n]).
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_common.h"

#define ACT_BLOCK_BYTES (768 * 1024)  // activation rows per block, L2-resident (of 2 MiB)

#if defined(PAGEDLM_AMX) && defined(__AMX_INT8__)
#define PAGEDLM_AMX_INT8 1

// C tiles 0, 1 (rows m0 .. m0 + 15) and 2, 3 (the next 16, when MT == 2) = A . B over K
// values k0 .. k1 - 1 for weight tiles t0 (tile 6) and t0 + 1 (tile 7, when NT == 2); A rows in
// tiles 4 and 5.
static inline __attribute__((always_inline)) void block(const int8_t* aq, const uint8_t* qs,
                                                        int64_t m0, int64_t t0, int64_t K,
                                                        int64_t k0, int64_t k1, const int MT,
                                                        const int NT) {
  _tile_zero(0);
  if (NT > 1) _tile_zero(1);
  if (MT > 1) _tile_zero(2);
  if (MT > 1 && NT > 1) _tile_zero(3);
  const int8_t* a = aq + m0 * K;
  const uint8_t* b0 = qs + t0 * (K / 4) * 64;
  const uint8_t* b1 = b0 + (K / 4) * 64;
  for (int64_t k = k0; k < k1; k += 64) {
    _tile_loadd(4, a + k, K);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_dpbsud(0, 4, 6);
    if (NT > 1) {
      _tile_loadd(7, b1 + k * 16, 64);
      _tile_dpbsud(1, 4, 7);
    }
    if (MT > 1) {
      _tile_loadd(5, a + 16 * K + k, K);
      _tile_dpbsud(2, 5, 6);
      if (NT > 1) _tile_dpbsud(3, 5, 7);
    }
  }
}

// acc[r] (+)= as[m][b] * (c[r] - corr[m][b]) for rows m = m0 + r < m0 + rows; nb blocks a row.
static inline void accumulate(const int32_t* c, const float* as, const int32_t* corr,
                              int64_t nb, int64_t b, int64_t m0, int64_t rows, float* acc,
                              int first) {
  for (int64_t r = 0; r < rows; r++) {
    const int64_t at = (m0 + r) * nb + b;
    const __m512i v = _mm512_sub_epi32(_mm512_load_si512(c + 16 * r), _mm512_set1_epi32(corr[at]));
    const __m512 f = _mm512_cvtepi32_ps(v), s = _mm512_set1_ps(as[at]);
    __m512 out = first ? _mm512_mul_ps(f, s) : _mm512_fmadd_ps(f, s, _mm512_load_ps(acc + 16 * r));
    _mm512_store_ps(acc + 16 * r, out);
  }
}

// y rows m0 .. m0 + rows - 1, the columns of weight tile t: ws[n] * acc (+ bias).
static inline void finish(const float* acc, const float* ws, const void* bias, void* y,
                          int64_t ldy, int64_t m0, int64_t rows, int64_t t, int64_t N, int bf16) {
  const int64_t n0 = t * TILE;
  const __mmask16 lanes = N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
  const __m512 w = _mm512_loadu_ps(ws + n0);
  __m512 b = _mm512_setzero_ps();
  if (bias != NULL && bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, (const uint16_t*)bias + n0);
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if (bias != NULL) {
    b = _mm512_maskz_loadu_ps(lanes, (const float*)bias + n0);
  }
  for (int64_t r = 0; r < rows; r++) {
    const __m512 out = _mm512_fmadd_ps(_mm512_load_ps(acc + 16 * r), w, b);
    store16_lanes(y, (m0 + r) * ldy + n0, out, bf16, lanes);
  }
}
#endif

int int8_gemm_amx_supported(void) {
#ifdef PAGEDLM_AMX_INT8
  return amx_permitted();
#else
  return 0;
#endif
}

// x [M, K] bf16/fp32; qs [ceil(N / 16)][K / 4][64]; ws [ceil(N / 16) * 16] fp32 per-channel
// scales (padding rows 0); bias [N] in x's dtype or NULL; y rows ldy apart; activations in
// blocks of QB (a multiple of 64 dividing K). Returns 1 if computed; 0 without AMX-INT8, for
// shapes outside these rules, or when out of memory.
int int8_gemm_amx(const void* x, const uint8_t* qs, const float* ws, const void* bias, void* y,
                  int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t QB, int bf16,
                  int num_threads) {
#ifdef PAGEDLM_AMX_INT8
  if (M < 1 || N < 1 || QB < 64 || QB % 64 || K % QB || !amx_permitted()) return 0;
  const int64_t mpad = (M + 15) / 16 * 16, tiles = (N + TILE - 1) / TILE, nb = K / QB;
  int64_t rows_per_block = ACT_BLOCK_BYTES / K / 32 * 32;
  if (rows_per_block < 32) rows_per_block = 32;
  int8_t* aq = aligned_alloc(64, mpad * K);
  float* as = calloc(mpad * nb, sizeof(float));
  int32_t* corr = calloc(mpad * nb, sizeof(int32_t));
  int ok = aq != NULL && as != NULL && corr != NULL;
  if (ok) {
    memset(aq + M * K, 0, (mpad - M) * K);
#pragma omp parallel num_threads(num_threads)
    {
      float* buf = malloc(sizeof(float) * act_scratch(K));
      if (buf == NULL) {
#pragma omp atomic write
        ok = 0;
      }
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; m++) {
        if (buf == NULL) continue;
        int32_t* sums16 = (int32_t*)(buf + K + K / 32);
        quantize_row(x, m, K, bf16, QB, aq + m * K, as + m * nb, sums16, buf);
        for (int64_t b = 0; b < nb; b++) {
          int32_t total = 0;
          for (int64_t s = b * QB / 16; s < (b + 1) * QB / 16; s++) total += sums16[s];
          corr[m * nb + b] = 128 * total;
        }
      }
      free(buf);
    }
  }
  if (ok) {
#pragma omp parallel num_threads(num_threads)
    {
      amx_configure_full_tiles(8);
      int32_t c[4][256] __attribute__((aligned(64)));
      float acc[4][256] __attribute__((aligned(64)));
      for (int64_t mb = 0; mb < M; mb += rows_per_block) {
        const int64_t mend = mb + rows_per_block < M ? mb + rows_per_block : M;
#pragma omp for schedule(static)
      for (int64_t p = 0; p < (tiles + 1) / 2; p++) {
        const int64_t t0 = 2 * p;
        const int NT = t0 + 1 < tiles ? 2 : 1;
        for (int64_t m0 = mb; m0 < mend; m0 += 32) {
          const int MT = M - m0 > 16 ? 2 : 1;
          const int64_t top = M - m0 < 16 ? M - m0 : 16;
          const int64_t bottom = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
          for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * QB, k1 = k0 + QB;
            if (MT == 2 && NT == 2) block(aq, qs, m0, t0, K, k0, k1, 2, 2);
            else if (MT == 2) block(aq, qs, m0, t0, K, k0, k1, 2, 1);
            else if (NT == 2) block(aq, qs, m0, t0, K, k0, k1, 1, 2);
            else block(aq, qs, m0, t0, K, k0, k1, 1, 1);
            _tile_stored(0, c[0], 64);
            if (NT > 1) _tile_stored(1, c[1], 64);
            if (MT > 1) _tile_stored(2, c[2], 64);
            if (MT > 1 && NT > 1) _tile_stored(3, c[3], 64);
            for (int j = 0; j < NT; j++) {
              accumulate(c[j], as, corr, nb, b, m0, top, acc[j], b == 0);
              if (MT > 1) accumulate(c[2 + j], as, corr, nb, b, m0 + 16, bottom, acc[2 + j], b == 0);
            }
          }
          for (int j = 0; j < NT; j++) {
            finish(acc[j], ws, bias, y, ldy, m0, top, t0 + j, N, bf16);
            if (MT > 1) finish(acc[2 + j], ws, bias, y, ldy, m0 + 16, bottom, t0 + j, N, bf16);
          }
        }
      }
      }
      _tile_release();
    }
  }
  free(aq);
  free(as);
  free(corr);
  return ok;
#else
  (void)x, (void)qs, (void)ws, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K;
  (void)QB, (void)bf16, (void)num_threads;
  return 0;
#endif
}
