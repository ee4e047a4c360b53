// y[M, N] = x[M, K] . W[N, K]^T (+ bias) for decode-sized batches (M <= 64), bf16, on AMX.
// Decode steps read every weight from DRAM, and there this kernel beats oneDNN up to 64 rows
// (past that it is bound by the tile products and oneDNN wins).
//
// oneDNN streams the weight at ~12 GB/s here when M is small; this kernel reads the dense
// row-major weight once, 16 output rows at a time as AMX A tiles straight from memory, with
// software prefetch two blocks ahead (~18 GB/s), against x^T laid out once in the pair-
// interleaved form AMX wants for B. Sums are fp32; the bias is added before rounding to bf16.
#include <stdlib.h>

#include "common.h"

#define PREFETCH_BLOCKS 2

#ifdef PAGEDLM_AMX
// C tiles 0 .. MT - 1 = W[16 rows of block nb] . x^T[:, 16 j .. 16 j + 15]; A = tile 4, B = 5.
static inline __attribute__((always_inline)) void row_block(const uint16_t* w, const uint32_t* xt,
                                                            int64_t nb, int64_t N, int64_t K,
                                                            int64_t mpad, const int MT,
                                                            float* c) {
  const char* rows = (const char*)(w + nb * 16 * K);
  const char* ahead = (const char*)(w + (nb + PREFETCH_BLOCKS) * 16 * K);
  const int prefetch = (nb + PREFETCH_BLOCKS) * 16 < N;
  _tile_zero(0);
  if (MT > 1) _tile_zero(1);
  if (MT > 2) _tile_zero(2);
  if (MT > 3) _tile_zero(3);
  for (int64_t s = 0; s < K / 32; s++) {
    _tile_loadd(4, rows + s * 64, K * 2);
    if (prefetch)
      for (int r = 0; r < 16; r++) _mm_prefetch(ahead + r * K * 2 + s * 64, _MM_HINT_T0);
    const uint32_t* xs = xt + s * 256 * MT;  // MT contiguous 1 KB B tiles for this K step
    _tile_loadd(5, xs, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (MT > 1) {
      _tile_loadd(5, xs + 256, 64);
      _tile_dpbf16ps(1, 4, 5);
    }
    if (MT > 2) {
      _tile_loadd(5, xs + 512, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (MT > 3) {
      _tile_loadd(5, xs + 768, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, mpad * 4);
  if (MT > 1) _tile_stored(1, c + 16, mpad * 4);
  if (MT > 2) _tile_stored(2, c + 32, mpad * 4);
  if (MT > 3) _tile_stored(3, c + 48, mpad * 4);
}
#endif

// Returns 0 (and computes nothing) unless AMX is there and M <= 64, N % 16 == 0, K % 32 == 0;
// 0 too when out of memory.
int small_batch_linear(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                       int64_t M, int64_t N, int64_t K, int num_threads) {
#ifdef PAGEDLM_AMX
  if (M < 1 || M > 64 || N % 16 || K % 32 || !amx_permitted()) return 0;
  const int MT = (int)((M + 15) / 16);
  const int64_t mpad = 16 * MT;
  int ok = 1;
  // x^T by pairs, tiled: xt[step s][tile j][pair r][column i] = (x[m][2p], x[m][2p + 1]) for
  // p = 16 s + r, m = 16 j + i, so each B tile is one contiguous kilobyte.
  uint32_t* xt = alloc_lines((K / 2) * mpad * 4);
  if (xt == NULL) return 0;
  // per (s, j) a 16 x 16 transpose of 32-bit pairs, zeros for rows past M (a scalar loop over
  // every value, on one thread before the parallel part, was 3-8% of a decode step's linears)
  const float* x32 = (const float*)x;
  for (int64_t s = 0; s < K / 32; s++)
    for (int j = 0; j < MT; j++) {
      __m512 r[16];
      for (int i = 0; i < 16; i++)
        r[i] = 16 * j + i < M ? _mm512_loadu_ps(x32 + (16 * j + i) * (K / 2) + 16 * s)
                              : _mm512_setzero_ps();
      transpose16(r);
      for (int p = 0; p < 16; p++)
        _mm512_storeu_ps((float*)xt + ((s * MT + j) * 16 + p) * 16, r[p]);
    }
#pragma omp parallel num_threads(num_threads)
  {
    amx_configure_full_tiles(6);
    float* c = alloc_lines(sizeof(float) * 16 * 64);  // [16 rows of W][mpad]
    if (c == NULL) {
#pragma omp atomic write
      ok = 0;
    }
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++) {
      if (c == NULL) continue;
      switch (MT) {
        case 1: row_block(w, xt, nb, N, K, mpad, 1, c); break;
        case 2: row_block(w, xt, nb, N, K, mpad, 2, c); break;
        case 3: row_block(w, xt, nb, N, K, mpad, 3, c); break;
        default: row_block(w, xt, nb, N, K, mpad, 4, c);
      }
      __m512 b = _mm512_setzero_ps();
      if (bias != NULL) b = load16(bias, nb * 16, 1);
      for (int j = 0; j < MT; j++) {  // c is [n][m]: transpose 16 x 16 pieces into y[m][n]
        __m512 r[16];
        for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_ps(c + n * mpad + 16 * j);
        transpose16(r);
        for (int i = 0; i < 16 && 16 * j + i < M; i++)
          store16(y, (16 * j + i) * N + nb * 16, _mm512_add_ps(r[i], b), 1);
      }
    }
    free(c);
    _tile_release();
  }
  free(xt);
  return ok;
#else
  (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
  return 0;
#endif
}

int pagedlm_amx_disabled = 0;

void set_amx_disabled(int disabled) { pagedlm_amx_disabled = disabled; }

int small_batch_linear_supported(void) {
#ifdef PAGEDLM_AMX
  return amx_permitted();
#else
  return 0;
#endif
}
