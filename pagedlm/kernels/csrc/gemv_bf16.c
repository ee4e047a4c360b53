// y[M, N] = x[M, K] . W[N, K]^T (+ bias), bf16, for decode-sized M without AMX (AVX-512 BF16,
// AVX2, portable).
//
// AVX-512 BF16: 4 weight rows at a time are read once from DRAM (64-byte steps, vdpbf16ps),
// each step against up to 4 activation rows kept in L1/L2; bigger M walks the same 4 weight
// rows again per 4 activation rows (they are in L2 by then). Software prefetch runs
// PREFETCH_ROWS rows ahead of the first pass. OpenMP splits N. Sums are fp32, the bias is
// added before rounding to bf16.
//
// Portable: the same loop nest in plain C on fp32 (gcc vectorizes it with FMA); correct
// everywhere, fast nowhere -- `small_batch_linear_isa()` tells the caller which one runs.
#include <stdlib.h>

#include "common.h"

#define ROWS 4           // weight rows per step
#define COLS 4           // activation rows per pass
#define PREFETCH_ROWS 8  // prefetch distance, in weight rows

static inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = ((uint32_t)h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#if defined(PAGEDLM_AVX512) && defined(__AVX512BF16__)
#define PAGEDLM_AVX512_BF16 1

// Rows n0 .. n0 + nr - 1 of W against activation rows m0 .. m0 + mt - 1.
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t* x, const uint16_t* w,
                                                            const uint16_t* bias, uint16_t* y,
                                                            int64_t n0, const int nr, int64_t m0,
                                                            const int mt, int64_t N, int64_t K,
                                                            int prefetch) {
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < nr; r++)
    for (int j = 0; j < mt; j++) acc[r][j] = _mm512_setzero_ps();
  const int64_t kfull = K & ~(int64_t)31;
  for (int64_t k = 0; k < kfull; k += 32) {
    __m512bh wv[ROWS];
    for (int r = 0; r < nr; r++) {
      wv[r] = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k);
      if (prefetch) _mm_prefetch((const char*)(w + (n0 + r + PREFETCH_ROWS) * K + k), _MM_HINT_T0);
    }
    for (int j = 0; j < mt; j++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + j) * K + k);
      for (int r = 0; r < nr; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[r], xv);
    }
  }
  if (kfull < K) {  // masked tail: zeros contribute nothing
    const __mmask32 mask = (__mmask32)((1ull << (K - kfull)) - 1);
    __m512bh wv[ROWS];
    for (int r = 0; r < nr; r++)
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + r) * K + kfull);
    for (int j = 0; j < mt; j++) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + j) * K + kfull);
      for (int r = 0; r < nr; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[r], xv);
    }
  }
  for (int r = 0; r < nr; r++) {
    const float b = bias != NULL ? bf16_to_f32(bias[n0 + r]) : 0.f;
    for (int j = 0; j < mt; j++) y[(m0 + j) * N + n0 + r] = to_bf16(_mm512_reduce_add_ps(acc[r][j]) + b);
  }
}

static void gemv_bf16_avx512(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                             uint16_t* y, int64_t M, int64_t N, int64_t K, int num_threads) {
  const int64_t blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t nb = 0; nb < blocks; nb++) {
    const int64_t n0 = nb * ROWS;
    const int nr = N - n0 < ROWS ? (int)(N - n0) : ROWS;
    const int prefetch = n0 + ROWS + PREFETCH_ROWS <= N;
    for (int64_t m0 = 0; m0 < M; m0 += COLS) {
      const int mt = M - m0 < COLS ? (int)(M - m0) : COLS;
      const int pf = prefetch && m0 == 0;
      if (nr == ROWS) {  // constant nr/mt: the loops above unroll into registers
        switch (mt) {
          case 1: bf16_tile(x, w, bias, y, n0, ROWS, m0, 1, N, K, pf); break;
          case 2: bf16_tile(x, w, bias, y, n0, ROWS, m0, 2, N, K, pf); break;
          case 3: bf16_tile(x, w, bias, y, n0, ROWS, m0, 3, N, K, pf); break;
          default: bf16_tile(x, w, bias, y, n0, ROWS, m0, COLS, N, K, pf);
        }
      } else {
        for (int r = 0; r < nr; r++) bf16_tile(x, w, bias, y, n0 + r, 1, m0, mt, N, K, 0);
      }
    }
  }
}
#endif

#ifdef PAGEDLM_AVX512_BF16
// Blocked weight: wb[nb][p][16][2] = (W[16 nb + i][2 p], W[16 nb + i][2 p + 1]) -- each 64-byte
// line holds a k pair of 16 output rows, so one vdpbf16ps against the broadcast x pair adds to
// 16 outputs at once: no horizontal sums, and the weight is one sequential stream per block.
// NB blocks (16 NB outputs) against MT activation rows per pass.
static inline __attribute__((always_inline)) void blocked_tile(
    const uint32_t* x, const uint32_t* wb, const uint16_t* bias, uint16_t* y, int64_t nb0,
    const int NB, int64_t m0, const int MT, int64_t N, int64_t KP, int prefetch) {
  __m512 acc[4][8];
  for (int b = 0; b < NB; b++)
    for (int m = 0; m < MT; m++) acc[b][m] = _mm512_setzero_ps();
  const uint32_t* w0 = wb + nb0 * KP * 16;
  for (int64_t p = 0; p < KP; p++) {
    __m512bh wv[4];
    for (int b = 0; b < NB; b++) {
      wv[b] = (__m512bh)_mm512_loadu_si512(w0 + (b * KP + p) * 16);
      if (prefetch) _mm_prefetch((const char*)(w0 + ((b + NB) * KP + p) * 16), _MM_HINT_T0);
    }
    for (int m = 0; m < MT; m++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[(m0 + m) * KP + p]);
      for (int b = 0; b < NB; b++) acc[b][m] = _mm512_dpbf16_ps(acc[b][m], wv[b], xv);
    }
  }
  for (int b = 0; b < NB; b++) {
    const int64_t n = (nb0 + b) * 16;
    const __m512 bv = bias != NULL ? load16(bias, n, 1) : _mm512_setzero_ps();
    for (int m = 0; m < MT; m++) store16(y, (m0 + m) * N + n, _mm512_add_ps(acc[b][m], bv), 1);
  }
}

// More than 2 rows: pairs of blocks (32 outputs) with K in chunks of CHUNK_PAIRS k pairs (2 x
// 128 x 64 B = 16 KB of weights) that stay in L1 while every 8-row panel of x runs against
// them; x is first copied into panels ([panel][KP][8] pairs), so a k-step's 8 broadcasts lie
// in one 32-byte run. The first panel prefetches into L2 the chunk the thread runs next (the
// pair's next, or the next pair's first). A panel's fp32 sums wait in `acc` between chunks, so
// each output adds its k pairs in blocked_tile's order: the same bits. Against passes of 8
// rows over whole rows of weights (read from L2 after the first), 1.05-1.2x at 8-64 rows (Zen
// 4: 3B gate_up at 32 rows 0.35 -> 0.39 TFLOPS).
#define CHUNK_PAIRS 128

// acc[2 m + b] += x panel row m . block b of the pair at w0, over k pairs p0 .. p0 + pn - 1;
// with pf != 0, each step's weight lines pf bytes on are prefetched into L2.
static inline __attribute__((always_inline)) void pair_chunk(const uint32_t* xp,
                                                             const uint32_t* w0, int64_t KP,
                                                             int64_t p0, int64_t pn, __m512* acc,
                                                             int64_t pf, const int MT) {
  __m512 a0[8], a1[8];
  for (int m = 0; m < MT; m++) a0[m] = acc[2 * m], a1[m] = acc[2 * m + 1];
  for (int64_t p = p0; p < p0 + pn; p++) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + p * 16);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w0 + (KP + p) * 16);
    if (pf) {
      _mm_prefetch((const char*)(w0 + p * 16) + pf, _MM_HINT_T1);
      _mm_prefetch((const char*)(w0 + (KP + p) * 16) + pf, _MM_HINT_T1);
    }
    for (int m = 0; m < MT; m++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[p * 8 + m]);
      a0[m] = _mm512_dpbf16_ps(a0[m], b0, xv);
      a1[m] = _mm512_dpbf16_ps(a1[m], b1, xv);
    }
  }
  for (int m = 0; m < MT; m++) acc[2 * m] = a0[m], acc[2 * m + 1] = a1[m];
}

typedef void (*PairChunk)(const uint32_t*, const uint32_t*, int64_t, int64_t, int64_t, __m512*,
                          int64_t);
#define PAIR_CHUNK(MT)                                                                     \
  static __attribute__((noinline)) void pair_chunk_##MT(const uint32_t* xp,                \
                                                        const uint32_t* w0, int64_t KP,    \
                                                        int64_t p0, int64_t pn, __m512* acc, \
                                                        int64_t pf) {                      \
    pair_chunk(xp, w0, KP, p0, pn, acc, pf, MT);                                           \
  }
PAIR_CHUNK(1) PAIR_CHUNK(2) PAIR_CHUNK(3) PAIR_CHUNK(4) PAIR_CHUNK(5) PAIR_CHUNK(6)
PAIR_CHUNK(7) PAIR_CHUNK(8)
static const PairChunk PAIR_CHUNKS[8] = {pair_chunk_1, pair_chunk_2, pair_chunk_3, pair_chunk_4,
                                         pair_chunk_5, pair_chunk_6, pair_chunk_7, pair_chunk_8};

// The first 2 * pairs blocks of y (M > 2) as above; 0 when out of memory.
static int blocked_pairs(const uint32_t* x, const uint32_t* wb, const uint16_t* bias,
                         uint16_t* y, int64_t M, int64_t pairs, int64_t N, int64_t KP,
                         int num_threads) {
  const int64_t panels = (M + 7) / 8;
  // x's panels [panel][KP][8] (zeros past row M), and each thread's sums [panel][8][2 blocks]
  uint32_t* xp = alloc_lines(sizeof(uint32_t) * panels * KP * 8);
  if (xp == NULL) return 0;
  for (int64_t q = 0; q < panels; q++)
    for (int64_t p = 0; p < KP; p++)
      for (int64_t m = 0; m < 8; m++)
        xp[(q * KP + p) * 8 + m] = q * 8 + m < M ? x[(q * 8 + m) * KP + p] : 0;
  int ok = 1;
#pragma omp parallel num_threads(num_threads)
  {
    __m512* acc = alloc_lines(sizeof(__m512) * panels * 16);
    if (acc == NULL) {
#pragma omp atomic write
      ok = 0;
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < pairs; g++) {
      if (acc == NULL) continue;
      const uint32_t* w0 = wb + g * 2 * KP * 16;
      for (int64_t i = 0; i < panels * 16; i++) acc[i] = _mm512_setzero_ps();
      for (int64_t p0 = 0; p0 < KP; p0 += CHUNK_PAIRS) {
        const int64_t pn = KP - p0 < CHUNK_PAIRS ? KP - p0 : CHUNK_PAIRS;
        for (int64_t q = 0; q < panels; q++) {
          int64_t pf = 0;  // a block is KP * 64 bytes; the next pair starts 2 blocks on
          if (q == 0) pf = p0 + pn < KP ? pn * 64 : g + 1 < pairs ? (2 * KP - p0) * 64 : 0;
          const int mt = M - q * 8 < 8 ? (int)(M - q * 8) : 8;
          PAIR_CHUNKS[mt - 1](xp + q * KP * 8, w0, KP, p0, pn, acc + q * 16, pf);
        }
      }
      const int64_t n = g * 32;  // the pair's first output
      const __m512 bv0 = bias != NULL ? load16(bias, n, 1) : _mm512_setzero_ps();
      const __m512 bv1 = bias != NULL ? load16(bias, n + 16, 1) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; m++) {
        const __m512* sums = acc + (m / 8) * 16 + (m % 8) * 2;
        store16(y, m * N + n, _mm512_add_ps(sums[0], bv0), 1);
        store16(y, m * N + n + 16, _mm512_add_ps(sums[1], bv1), 1);
      }
    }
    free(acc);
  }
  free(xp);
  return ok;
}

// y[M, N] = x[M, 2 KP] . W^T with W blocked as above (N = 16 * NBLK); 0 when out of memory.
int gemv_bf16_blocked(const uint16_t* x, const uint16_t* wb, const uint16_t* bias, uint16_t* y,
                      int64_t M, int64_t NBLK, int64_t KP, int num_threads) {
  if (M < 1 || NBLK < 1 || KP < 1) return 0;
  const int64_t N = NBLK * 16;
  const uint32_t* x32 = (const uint32_t*)x;
  const uint32_t* w32 = (const uint32_t*)wb;
  int64_t nb0 = 0;  // blocks from here on go through blocked_tile
  if (M > 2) {
    if (!blocked_pairs(x32, w32, bias, y, M, NBLK / 2, N, KP, num_threads)) return 0;
    nb0 = NBLK / 2 * 2;
  }
  // 1-2 rows: 4 blocks per step (more streams in flight); the last blocks one at a time
  const int64_t groups = (NBLK - nb0 + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t g = 0; g < groups; g++) {
    const int64_t b0 = nb0 + g * 4;
    const int nb = NBLK - b0 < 4 ? (int)(NBLK - b0) : 4;
    const int pf = b0 + 8 <= NBLK;
    if (nb == 4 && M == 1) blocked_tile(x32, w32, bias, y, b0, 4, 0, 1, N, KP, pf);
    else if (nb == 4 && M == 2) blocked_tile(x32, w32, bias, y, b0, 4, 0, 2, N, KP, pf);
    else
      for (int b = 0; b < nb; b++)
        for (int64_t m = 0; m < M; m++) blocked_tile(x32, w32, bias, y, b0 + b, 1, m, 1, N, KP, 0);
  }
  return 1;
}
#else
int gemv_bf16_blocked(const uint16_t* x, const uint16_t* wb, const uint16_t* bias, uint16_t* y,
                      int64_t M, int64_t NBLK, int64_t KP, int num_threads) {
  (void)x, (void)wb, (void)bias, (void)y, (void)M, (void)NBLK, (void)KP, (void)num_threads;
  return 0;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDLM_AVX2 1
// AVX2 (no bf16 arithmetic): weights widened to fp32 in registers (a 16-bit shift), x converted
// to fp32 once per call; 4 weight rows x 2 activation rows of 8-lane fp32 sums (13 of the 16
// ymm registers). Same loop nest as the AVX-512 one; sums fp32, the bias added before rounding.
#define AVX2_COLS 2

static inline __m256 load8_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) void avx2_tile(const float* xf, const uint16_t* w,
                                                            const uint16_t* bias, uint16_t* y,
                                                            int64_t n0, const int nr, int64_t m0,
                                                            const int mt, int64_t N, int64_t K,
                                                            int prefetch) {
  __m256 acc[ROWS][AVX2_COLS];
  for (int r = 0; r < nr; r++)
    for (int j = 0; j < mt; j++) acc[r][j] = _mm256_setzero_ps();
  const int64_t kfull = K & ~(int64_t)7;
  for (int64_t k = 0; k < kfull; k += 8) {
    __m256 wv[ROWS];
    for (int r = 0; r < nr; r++) {
      wv[r] = load8_bf16(w + (n0 + r) * K + k);
      if (prefetch && (k & 31) == 0)
        _mm_prefetch((const char*)(w + (n0 + r + PREFETCH_ROWS) * K + k), _MM_HINT_T0);
    }
    for (int j = 0; j < mt; j++) {
      const __m256 xv = _mm256_loadu_ps(xf + (m0 + j) * K + k);
      for (int r = 0; r < nr; r++) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < nr; r++) {
    const float b = bias != NULL ? bf16_to_f32(bias[n0 + r]) : 0.f;
    for (int j = 0; j < mt; j++) {
      float s = hsum8(acc[r][j]);
      for (int64_t k = kfull; k < K; k++)
        s += bf16_to_f32(w[(n0 + r) * K + k]) * xf[(m0 + j) * K + k];
      y[(m0 + j) * N + n0 + r] = to_bf16(s + b);
    }
  }
}

// Returns 0 when out of memory (nothing computed), else 1.
static int gemv_bf16_avx2(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                          uint16_t* y, int64_t M, int64_t N, int64_t K, int num_threads) {
  float* xf = malloc(sizeof(float) * M * K);
  if (xf == NULL) return 0;
  for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
  const int64_t blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t nb = 0; nb < blocks; nb++) {
    const int64_t n0 = nb * ROWS;
    const int nr = N - n0 < ROWS ? (int)(N - n0) : ROWS;
    const int prefetch = n0 + ROWS + PREFETCH_ROWS <= N;
    for (int64_t m0 = 0; m0 < M; m0 += AVX2_COLS) {
      const int mt = M - m0 < AVX2_COLS ? (int)(M - m0) : AVX2_COLS;
      const int pf = prefetch && m0 == 0;
      if (nr == ROWS && mt == 1) avx2_tile(xf, w, bias, y, n0, ROWS, m0, 1, N, K, pf);
      else if (nr == ROWS) avx2_tile(xf, w, bias, y, n0, ROWS, m0, AVX2_COLS, N, K, pf);
      else
        for (int r = 0; r < nr; r++) avx2_tile(xf, w, bias, y, n0 + r, 1, m0, mt, N, K, 0);
    }
  }
  free(xf);
  return 1;
}
#endif

// Returns 0 when out of memory (nothing computed), else 1.
static int gemv_bf16_portable(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                              uint16_t* y, int64_t M, int64_t N, int64_t K, int num_threads) {
  float* xf = malloc(sizeof(float) * M * K);
  if (xf == NULL) return 0;
  for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
  int ok = 1;
#pragma omp parallel num_threads(num_threads)
  {
    float* wf = malloc(sizeof(float) * K);
    if (wf == NULL) {
#pragma omp atomic write
      ok = 0;
    } else {
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; n++) {
        for (int64_t k = 0; k < K; k++) wf[k] = bf16_to_f32(w[n * K + k]);
        const float b = bias != NULL ? bf16_to_f32(bias[n]) : 0.f;
        for (int64_t m = 0; m < M; m++) {
          const float* xr = xf + m * K;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t k = 0; k < K; k++) s += wf[k] * xr[k];
          y[m * N + n] = to_bf16(s + b);
        }
      }
      free(wf);
    }
  }
  free(xf);
  return ok;
}

// isa: 1 = AVX-512 BF16, 2 = AVX2, 0 = portable. Returns 1 if computed, 0 if that ISA is not
// compiled in or memory ran out.
int gemv_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M,
              int64_t N, int64_t K, int isa, int num_threads) {
  if (M < 1 || N < 1 || K < 1) return 0;
  if (isa == 1) {
#ifdef PAGEDLM_AVX512_BF16
    gemv_bf16_avx512(x, w, bias, y, M, N, K, num_threads);
    return 1;
#else
    return 0;
#endif
  }
  if (isa == 2) {
#ifdef PAGEDLM_AVX2
    return gemv_bf16_avx2(x, w, bias, y, M, N, K, num_threads);
#else
    return 0;
#endif
  }
  return gemv_bf16_portable(x, w, bias, y, M, N, K, num_threads);
}

int gemv_bf16_avx512_compiled(void) {
#ifdef PAGEDLM_AVX512_BF16
  return 1;
#else
  return 0;
#endif
}

int gemv_bf16_avx2_compiled(void) {
#ifdef PAGEDLM_AVX2
  return 1;
#else
  return 0;
#endif
}
