// Batched y[M, N] = x[M, K] . W[N, K]^T on packed GGUF weights (layout: gguf_matmul.c) in
// integer arithmetic, for prefill chunks and large decode batches (AVX-512 VNNI only; without
// it the caller dequantizes tiles for a float GEMM).
//
// 1. x is quantized per row and 32-value block to int8 exactly as the GEMV does
//    (quantize_act_row: per weight sub-block the offset correction, d, and d * sum for mins).
// 2. W is cut into tiles of NT = 32 output columns (two packed 16-row tiles). A thread unpacks
//    a tile into a scratch of bytes in VNNI order (16 rows x 4 bytes per vector, as packed),
//    scales and mins as [K / G][32]; a missing second half (N <= 16 past the first) is zeros.
//    8-bit quants of a full pair are read in place, not copied.
// 3. Rows are taken in blocks whose quantized activations fit in L2 next to the tile; with
//    enough rows the threads split the rows, else the tiles.
// 4. The microkernel holds MR activation rows x 32 columns: per sub-block, int32 accumulators
//    start at corr and take G / 4 vpdpbusd steps (weight quant u8 x activation quant s8, exact);
//    then fp32 acc += (float)(int sum) * d * scale (and -= min * d * sum with mins).
// Every sum is exact in int32 (|sum| <= 32 * 255 * 127); the float rounding differs from the
// GEMV's only in summation order.
#include <omp.h>

#include "gguf_common.h"

#ifdef PAGEDLM_VNNI
#define NT 32    // output columns per tile (two 16-lane vectors)
#define MR_MAX 6  // activation rows per microkernel call
#define ACT_BLOCK_BYTES (384 * 1024)  // quantized activation rows per block (L2: 1 MiB)
#define SPLIT_ROWS 256  // rows per thread from which threads split rows, not tiles

static inline __m512 load_scales(const QWeight* w, int mins, int64_t t, int64_t g) {
  switch (w->kind) {
    case SCALES_F16: return load_scales16(w, mins, t, g, SCALES_F16);
    case SCALES_I8_SUPER: return load_scales16(w, mins, t, g, SCALES_I8_SUPER);
    case SCALES_U8_SUPER: return load_scales16(w, mins, t, g, SCALES_U8_SUPER);
    default: return load_scales16(w, mins, t, g, SCALES_F32);
  }
}

// Where the microkernel reads the 16-row x 4-byte VNNI quads of a tile pair: quad q of half h
// at half[h] + q * step (64 bytes each). 8-bit weights of a full pair are read in place from
// the packed tiles; others from the thread's unpacked copy.
typedef struct {
  const uint8_t* half[2];
  int64_t step;
} Quads;

// Columns n0 .. n0 + 31 (tiles 2 tp, 2 tp + 1): scales and mins into sT and mT [K / G][32],
// and the quads into wt [K / 4][32][4] unless they can be read in place (returned view).
static inline __attribute__((always_inline)) Quads unpack_tile(const QWeight* w, int64_t tp,
                                                               uint8_t* restrict wt,
                                                               float* restrict sT,
                                                               float* restrict mT,
                                                               const int BITS) {
  const int64_t subs = w->K / w->group, tiles = num_tiles(w);
  const int in_place = BITS == 8 && 2 * tp + 1 < tiles;
  for (int half = 0; half < 2; half++) {
    const int64_t t = 2 * tp + half;
    for (int64_t s = 0; !in_place && s < w->K / 8; s++) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      if (t < tiles) kquad_pair(w, t, s, BITS, &lo, &hi);
      _mm512_store_si512(wt + (2 * s * NT + TILE * half) * 4, lo);
      _mm512_store_si512(wt + ((2 * s + 1) * NT + TILE * half) * 4, hi);
    }
    for (int64_t g = 0; g < subs; g++) {
      const __m512 zero = _mm512_setzero_ps();
      const int in = t < tiles;
      _mm512_store_ps(sT + g * NT + TILE * half, in ? load_scales(w, 0, t, g) : zero);
      if (mT != NULL)
        _mm512_store_ps(mT + g * NT + TILE * half, in ? load_scales(w, 1, t, g) : zero);
    }
  }
  if (!in_place) return (Quads){{wt, wt + 64}, 2 * 64};
  const uint8_t* first = w->qs + 2 * tp * (w->K / 4) * 64;
  return (Quads){{first, first + (w->K / 4) * 64}, 64};
}

static Quads unpack_tile_any(const QWeight* w, int64_t tp, uint8_t* wt, float* sT, float* mT) {
  switch (w->bits) {
    case 4: return unpack_tile(w, tp, wt, sT, mT, 4);
    case 5: return unpack_tile(w, tp, wt, sT, mT, 5);
    case 6: return unpack_tile(w, tp, wt, sT, mT, 6);
    default: return unpack_tile(w, tp, wt, sT, mT, 8);
  }
}

// out[i][0 .. 31] = dots of activation rows m0 .. m0 + MR - 1 with the tile's 32 columns.
static inline __attribute__((always_inline)) void micro(Quads wq,
                                                        const float* restrict sT,
                                                        const float* restrict mT,
                                                        const QAct* a, int64_t K, int64_t m0,
                                                        const int MR, const int G,
                                                        const int MINS, float* out) {
  const int64_t subs = K / G;
  const int8_t* rows[MR_MAX];
  const int32_t* corr[MR_MAX];
  const float* dd[MR_MAX];
  const float* ds[MR_MAX];
  for (int i = 0; i < MR; i++) {
    rows[i] = a->q + (m0 + i) * K;
    corr[i] = a->corr + (m0 + i) * subs;
    dd[i] = a->d + (m0 + i) * subs;
    ds[i] = MINS ? a->dsum + (m0 + i) * subs : NULL;
  }
  __m512 f[MR_MAX][2];
  for (int i = 0; i < MR; i++) f[i][0] = f[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < subs; g++) {
    __m512i acc[MR_MAX][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_set1_epi32(corr[i][g]);
    const uint8_t* w0p = wq.half[0] + g * (G / 4) * wq.step;
    const uint8_t* w1p = wq.half[1] + g * (G / 4) * wq.step;
    for (int s = 0; s < G / 4; s++) {
      const __m512i w0 = _mm512_loadu_si512(w0p + s * wq.step);
      const __m512i w1 = _mm512_loadu_si512(w1p + s * wq.step);
      for (int i = 0; i < MR; i++) {
        int32_t v;
        memcpy(&v, rows[i] + g * G + 4 * s, 4);
        const __m512i av = _mm512_set1_epi32(v);
        acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w0, av);
        acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], w1, av);
      }
    }
    const __m512 s0 = _mm512_load_ps(sT + g * NT), s1 = _mm512_load_ps(sT + g * NT + 16);
    for (int i = 0; i < MR; i++) {
      const __m512 dv = _mm512_set1_ps(dd[i][g]);
      f[i][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][0]), dv), s0, f[i][0]);
      f[i][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][1]), dv), s1, f[i][1]);
    }
    if (MINS) {
      const __m512 n0 = _mm512_load_ps(mT + g * NT), n1 = _mm512_load_ps(mT + g * NT + 16);
      for (int i = 0; i < MR; i++) {
        const __m512 sv = _mm512_set1_ps(ds[i][g]);
        f[i][0] = _mm512_fnmadd_ps(n0, sv, f[i][0]);
        f[i][1] = _mm512_fnmadd_ps(n1, sv, f[i][1]);
      }
    }
  }
  for (int i = 0; i < MR; i++) {
    _mm512_storeu_ps(out + i * NT, f[i][0]);
    _mm512_storeu_ps(out + i * NT + 16, f[i][1]);
  }
}

#define MICRO_FOR(G, MINS)                                                                   \
  static void micro_g##G##_m##MINS(Quads wq, const float* sT, const float* mT,               \
                                   const QAct* a, int64_t K, int64_t m0, int mr,          \
                                   float* out) {                                             \
    switch (mr) {                                                                            \
      case 6: micro(wq, sT, mT, a, K, m0, 6, G, MINS, out); break;                           \
      case 5: micro(wq, sT, mT, a, K, m0, 5, G, MINS, out); break;                           \
      case 4: micro(wq, sT, mT, a, K, m0, 4, G, MINS, out); break;                           \
      case 3: micro(wq, sT, mT, a, K, m0, 3, G, MINS, out); break;                           \
      case 2: micro(wq, sT, mT, a, K, m0, 2, G, MINS, out); break;                           \
      default: micro(wq, sT, mT, a, K, m0, 1, G, MINS, out);                                 \
    }                                                                                        \
  }
MICRO_FOR(16, 0)
MICRO_FOR(16, 1)
MICRO_FOR(32, 0)
MICRO_FOR(32, 1)

static void micro_any(const QWeight* w, Quads wq, const float* sT, const float* mT,
                      const QAct* a, int64_t m0, int mr, float* out) {
  const int64_t K = w->K;
  if (w->group == 16) {
    if (w->mins != NULL) micro_g16_m1(wq, sT, mT, a, K, m0, mr, out);
    else micro_g16_m0(wq, sT, mT, a, K, m0, mr, out);
  } else {
    if (w->mins != NULL) micro_g32_m1(wq, sT, mT, a, K, m0, mr, out);
    else micro_g32_m0(wq, sT, mT, a, K, m0, mr, out);
  }
}
#endif

int gguf_gemm_compiled(void) {
#ifdef PAGEDLM_VNNI
  return 1;
#else
  return 0;
#endif
}

// y [M, N] (bf16 or fp32, as x; rows ldy >= N elements apart) = x W^T (+ bias, in x's dtype).
// Returns 1 if computed; 0 for bad arguments, no AVX-512 VNNI compiled in, or out of memory.
int gguf_gemm(const void* x, const uint8_t* qs, const uint8_t* qh, const void* scales,
              const void* mins, const float* sup, const float* msup, const void* bias, void* y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int bits, int group, int offset,
              int kind, int bf16, int num_threads) {
#ifndef PAGEDLM_VNNI
  (void)x, (void)qs, (void)qh, (void)scales, (void)mins, (void)sup, (void)msup, (void)bias;
  (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)bits, (void)group, (void)offset, (void)kind;
  (void)bf16, (void)num_threads;
  return 0;
#else
  const QWeight w = {qs, qh, scales, mins, sup, msup, N, K, bits, group, offset, kind};
  if (!valid(&w) || M < 1 || ldy < N) return 0;
  const int64_t subs = K / group, tiles = (N + NT - 1) / NT, elem = bf16 ? 2 : 4;
  // Rows per block: its quantized activations stay in L2 while every tile passes over them.
  const int64_t block = K * MR_MAX > ACT_BLOCK_BYTES ? MR_MAX
                                                      : ACT_BLOCK_BYTES / K / MR_MAX * MR_MAX;
  // Enough rows: threads split the rows (each quantizes only its own); else the tiles (each
  // quantizes every row, a small cost next to reading the weights twice).
  const int split_rows = M >= SPLIT_ROWS * num_threads;
  int ok = 1;
  // One synchronization point (the region's end; a stalled thread at a barrier costs a whole
  // scheduler slice on a shared machine).
#pragma omp parallel num_threads(num_threads)
  {
    const int nth = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t r0 = split_rows ? M * me / nth : 0, r1 = split_rows ? M * (me + 1) / nth : M;
    const int64_t t0 = split_rows ? 0 : tiles * me / nth;
    const int64_t t1 = split_rows ? tiles : tiles * (me + 1) / nth;
    const int64_t rows = t1 > t0 ? r1 - r0 : 0;
    const char* xr = (const char*)x + r0 * K * elem;
    QAct a;
    float* buf = malloc(sizeof(float) * act_scratch(K));
    uint8_t* wt = aligned_alloc(64, NT * K);
    float* sT = aligned_alloc(64, sizeof(float) * NT * subs);
    float* mT = mins != NULL ? aligned_alloc(64, sizeof(float) * NT * subs) : NULL;
    const int mine = alloc_act(&a, &w, rows > 0 ? rows : 1) && buf != NULL && wt != NULL &&
                     sT != NULL && (mins == NULL || mT != NULL);
    if (!mine) {
#pragma omp atomic write
      ok = 0;
    } else {
      for (int64_t m = 0; m < rows; m++) quantize_act_row(xr, m, &w, bf16, &a, buf);
      for (int64_t b0 = 0; b0 < rows; b0 += block) {
        const int64_t b1 = rows - b0 < block ? rows : b0 + block;
        for (int64_t t = t0; t < t1; t++) {
          const int64_t n0 = t * NT;
          const int cols = N - n0 < NT ? (int)(N - n0) : NT;
          const Quads wq = unpack_tile_any(&w, t, wt, sT, mT);
          float bv[NT] = {0};
          if (bias != NULL) load_row(bias, n0, cols, bf16, bv);
          const __m512 bias0 = _mm512_loadu_ps(bv), bias1 = _mm512_loadu_ps(bv + 16);
          const __mmask16 lanes0 = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
          const __mmask16 lanes1 = cols >= NT ? 0xFFFF : cols > 16 ? (1u << (cols - 16)) - 1 : 0;
          for (int64_t m0 = b0; m0 < b1; m0 += MR_MAX) {
            const int mr = b1 - m0 < MR_MAX ? (int)(b1 - m0) : MR_MAX;
            float out[MR_MAX * NT];
            micro_any(&w, wq, sT, mT, &a, m0, mr, out);
            for (int i = 0; i < mr; i++) {
              const int64_t at = (r0 + m0 + i) * ldy + n0;
              const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(out + i * NT), bias0);
              const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(out + i * NT + 16), bias1);
              store16_lanes(y, at, v0, bf16, lanes0);
              store16_lanes(y, at + 16, v1, bf16, lanes1);
            }
          }
        }
      }
    }
    free_act(&a);
    free(buf);
    free(wt);
    free(sT);
    free(mT);
  }
  return ok;
#endif
}
