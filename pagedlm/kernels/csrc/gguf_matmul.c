// y[M, N] = x[M, K] . W[N, K]^T with W kept quantized (GGUF types repacked at load):
//
//   W[n][k] = scale[n][k / G] * (q[n][k] - offset) - min[n][k / G]      (min optional)
//
// q is unsigned, `bits` wide (4, 5, 6 or 8), in tiles of 16 rows stored in VNNI order: one
// 64-byte vector holds 4 consecutive values of each of the 16 rows (layout in
// pagedlm/kernels/gguf_pack.py). 8-bit q is stored as it is; narrower q as nibble
// pairs (two k-quad vectors per 64 bytes) plus 64-bit masks for bits 4 and 5.
//
// Decode (`gguf_gemv`): x is quantized per row and 32-value block to int8 (d = amax / 127,
// q = round-half-even(x * 127 / amax), as llama.cpp's Q8_0 does). Per tile and sub-block g,
// int32 lanes (one per weight row) start at -offset * (sum of g's activation quants) and take
// G / 4 vpdpbusd steps, each a k-quad vector of weight quants (u8) against 4 activation quants
// (s8) broadcast: exact integer sums, then fp32 acc += (float)sum * (scale x d), and with mins
// acc -= min * d * (sum of quants); scales and mins decoded as stored (fp16, or 8-bit
// sub-scales times the super-block's fp32 d). Without VNNI, AVX2 computes the same exact
// integer sums with vpmaddubsw (gguf_gemv_avx2.h); the portable path does it in plain C.
//
// Larger batches (`gguf_gemm`, gguf_gemm.c): the same activation quantization but per 256
// values on K-quants and per 128 on blocks of 32 where K allows, tile pairs unpacked to bytes
// in a per-thread scratch, a register-blocked vpdpbusd GEMM.
//
// Dequantization (`gguf_dequantize_rows`, for float GEMMs where there is no VNNI): rows of W
// exactly as the PyTorch twin computes them (fp32, no fused multiply-add).
//
// Shared pieces (weight descriptor, row quantization, tile unpacking): gguf_common.h.
#include <stdlib.h>

#include "gguf_common.h"

#define MT_MAX 4  // activation rows per pass over a tile

// ----------------------------------------------------------------- activations (GEMV)
// Quantized activations, per row m and weight sub-block g (G = 16 or 32 values): the int8
// quants, corr = -offset * (sum of the sub-block's quants), d of its 32-block, and for weights
// with mins dsum = d * (sum of the quants).
typedef struct {
  int8_t* q;      // [M][K]
  int32_t* corr;  // [M][K / G]
  float* d;       // [M][K / G]
  float* dsum;    // [M][K / G] or NULL
} QAct;

// Allocates a's arrays for M rows (dsum only for weights with mins); 0 when out of memory
// (free_act is still due).
static int alloc_act(QAct* a, const QWeight* w, int64_t M) {
  const int64_t subs = w->K / w->group;
  a->q = alloc_lines(M * w->K);
  a->corr = malloc(sizeof(int32_t) * M * subs);
  a->d = malloc(sizeof(float) * M * subs);
  a->dsum = w->mins != NULL ? malloc(sizeof(float) * M * subs) : NULL;
  return a->q && a->corr && a->d && (w->mins == NULL || a->dsum);
}

static void free_act(QAct* a) {
  free(a->q);
  free(a->corr);
  free(a->d);
  free(a->dsum);
}

// Row m of x into a; buf: act_scratch(K) floats.
static void quantize_act_row(const void* x, int64_t m, const QWeight* w, int bf16, const QAct* a,
                             float* restrict buf) {
  const int64_t K = w->K, G = w->group, subs = K / G;
  float* d32 = buf + K;
  int32_t* sums16 = (int32_t*)(d32 + K / 32);
  quantize_row(x, m, K, bf16, 32, a->q + m * K, d32, sums16, buf);
  for (int64_t g = 0; g < subs; g++) {
    const int32_t total = sub_block_sum(sums16, g, G);
    const float d = d32[(g * G) >> 5];
    a->corr[m * subs + g] = -w->offset * total;
    a->d[m * subs + g] = d;
    if (a->dsum != NULL) a->dsum[m * subs + g] = d * (float)total;
  }
}

// ----------------------------------------------------------------------------- tile dots

#include "gguf_gemv_avx2.h"  // the AVX2 tile dots (take QAct and MT_MAX from above)

// out[j][r] = dot of activation row m0 + j with row 16 t + r, from the unpacked tile q.
static void tile_dots_portable(const QWeight* w, const uint8_t* q, int64_t t, const QAct* a,
                               int64_t m0, int mt, float out[MT_MAX][TILE]) {
  const int64_t K = w->K, G = w->group, subs = K / G;
  for (int j = 0; j < mt; j++) {
    const int64_t m = m0 + j;
    const int8_t* x = a->q + m * K;
    for (int r = 0; r < TILE; r++) {
      float acc = 0.f;
      for (int64_t g = 0; g < subs; g++) {
        int32_t s = a->corr[m * subs + g];
        for (int64_t k = g * G; k < (g + 1) * G; k++) s += (int32_t)q[r * K + k] * x[k];
        acc += (float)s * (scale_of(w, 0, t, g, r) * a->d[m * subs + g]);
        if (w->mins != NULL) acc -= scale_of(w, 1, t, g, r) * a->dsum[m * subs + g];
      }
      out[j][r] = acc;
    }
  }
}

#ifdef PAGEDLM_VNNI
#define PREFETCH_BYTES 1024  // how far ahead of the k-quad being read (the weights stream)

static inline __attribute__((always_inline)) void prefetch_ahead(const QWeight* w, int64_t t,
                                                                 int64_t s, const int BITS) {
  const int64_t K = w->K;
  if (BITS == 8) {
    _mm_prefetch((const char*)(w->qs + (t * (K / 4) + 2 * s) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
    _mm_prefetch((const char*)(w->qs + (t * (K / 4) + 2 * s) * 64 + PREFETCH_BYTES + 64),
                 _MM_HINT_T0);
    return;
  }
  _mm_prefetch((const char*)(w->qs + (t * (K / 8) + s) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
  if (BITS > 4 && (s & 1) == 0)
    _mm_prefetch((const char*)(w->qh + (t * (K / 8) + s) * 16 * (BITS - 4) + PREFETCH_BYTES / 2),
                 _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void tile_dots(const QWeight* w, int64_t t,
                                                            const QAct* a, int64_t m0,
                                                            const int MT, const int BITS,
                                                            const int G, const int MINS,
                                                            const int KIND, __m512 acc[MT_MAX]) {
  const int64_t K = w->K, subs = K / G;
  for (int j = 0; j < MT; j++) acc[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < subs; g++) {
    __m512i even[MT_MAX], odd[MT_MAX];  // two dependency chains per activation row
    for (int j = 0; j < MT; j++) {
      even[j] = _mm512_set1_epi32(a->corr[(m0 + j) * subs + g]);
      odd[j] = _mm512_setzero_si512();
    }
    for (int64_t s = g * G / 8; s < (g + 1) * G / 8; s++) {
      __m512i lo, hi;
      prefetch_ahead(w, t, s, BITS);
      kquad_pair(w, t, s, BITS, &lo, &hi);
      for (int j = 0; j < MT; j++) {
        int32_t x4[2];
        memcpy(x4, a->q + (m0 + j) * K + 8 * s, 8);
        even[j] = _mm512_dpbusd_epi32(even[j], lo, _mm512_set1_epi32(x4[0]));
        odd[j] = _mm512_dpbusd_epi32(odd[j], hi, _mm512_set1_epi32(x4[1]));
      }
    }
    const __m512 ws = load_scales16(w, 0, t, g, KIND);
    for (int j = 0; j < MT; j++) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(even[j], odd[j]));
      const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(a->d[(m0 + j) * subs + g]));
      acc[j] = _mm512_fmadd_ps(sum, scale, acc[j]);
      if (MINS)
        acc[j] = _mm512_fnmadd_ps(load_scales16(w, 1, t, g, KIND),
                                  _mm512_set1_ps(a->dsum[(m0 + j) * subs + g]), acc[j]);
    }
  }
}

#define TILE_DOTS_FOR(NAME, BITS, G, MINS, KIND)                                           \
  static void tile_dots_##NAME(const QWeight* w, int64_t t, const QAct* a, int64_t m0, int mt, \
                               __m512 acc[MT_MAX]) {                                          \
    switch (mt) {                                                                             \
      case 4: tile_dots(w, t, a, m0, 4, BITS, G, MINS, KIND, acc); break;                     \
      case 3: tile_dots(w, t, a, m0, 3, BITS, G, MINS, KIND, acc); break;                     \
      case 2: tile_dots(w, t, a, m0, 2, BITS, G, MINS, KIND, acc); break;                     \
      default: tile_dots(w, t, a, m0, 1, BITS, G, MINS, KIND, acc);                           \
    }                                                                                         \
  }
PACKED_LAYOUTS(TILE_DOTS_FOR)  // others take the portable path

typedef void (*TileDots)(const QWeight*, int64_t, const QAct*, int64_t, int, __m512*);

// The kernel of w's layout, or NULL (a combination no GGUF type uses).
static TileDots tile_kernel(const QWeight* w) {
#define TILE_DOTS_CASE(NAME, BITS, G, MINS, KIND) \
  case LAYOUT_KEY(BITS, G, MINS, KIND): return tile_dots_##NAME;
  switch (layout_key(w)) {
    PACKED_LAYOUTS(TILE_DOTS_CASE)
    default: return NULL;
  }
#undef TILE_DOTS_CASE
}
#endif

// ---------------------------------------------------------------------------------- entries

int gguf_vnni_compiled(void) {
#ifdef PAGEDLM_VNNI
  return 1;
#else
  return 0;
#endif
}

int gguf_avx2_compiled(void) {
#ifdef PAGEDLM_AVX2_INT8
  return 1;
#else
  return 0;
#endif
}

// Row m of y (bf16 or fp32; rows ldy apart) at columns n0 .. n0 + cols - 1: v + bias.
static void store_out(void* y, int64_t ldy, const void* bias, int64_t m, int64_t n0, int cols,
                      float* v, int bf16) {
  float bv[TILE] = {0};
  if (bias != NULL) load_row(bias, n0, cols, bf16, bv);
  for (int r = 0; r < cols; r++) v[r] += bv[r];
  store_row(y, m * ldy + n0, cols, bf16, v);
}

// y [M, N] (bf16 or fp32, as x; rows ldy >= N elements apart, so that a caller can write into
// columns of a wider output) = x W^T (+ bias, in x's dtype). isa: 1 = AVX-512 VNNI,
// 2 = AVX2, 0 = portable. Returns 1 if computed; 0 for bad arguments, an ISA not compiled in,
// or out of memory.
int gguf_gemv(const void* x, const uint8_t* qs, const uint8_t* qh, const void* scales,
              const void* mins, const float* sup, const float* msup, const void* bias, void* y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int bits, int group, int offset,
              int kind, int bf16, int isa, int num_threads) {
  const QWeight w = {qs, qh, scales, mins, sup, msup, N, K, bits, group, offset, kind};
  if (!valid(&w) || M < 1 || ldy < N) return 0;
#ifndef PAGEDLM_VNNI
  if (isa == 1) return 0;
#endif
#ifndef PAGEDLM_AVX2_INT8
  if (isa == 2) return 0;
#endif
  QAct a;
  float* buf = malloc(sizeof(float) * act_scratch(K));
  int ok = alloc_act(&a, &w, M) && buf != NULL;
  for (int64_t m = 0; ok && m < M; m++) quantize_act_row(x, m, &w, bf16, &a, buf);
  free(buf);
  if (!ok) {
    free_act(&a);
    return 0;
  }
  const int64_t tiles = num_tiles(&w);
#ifdef PAGEDLM_VNNI
  const TileDots fast = isa == 1 ? tile_kernel(&w) : NULL;
#elif defined(PAGEDLM_AVX2_INT8)
  const TileDotsAvx2 fast = isa == 2 ? tile_kernel_avx2(&w) : NULL;
#else
  const void* fast = NULL;
#endif
#pragma omp parallel num_threads(num_threads)
  {
    uint8_t* q = fast != NULL ? NULL : malloc(TILE * K);
    if (fast == NULL && q == NULL) {
#pragma omp atomic write
      ok = 0;
    } else {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tiles; t++) {
        const int cols = N - t * TILE < TILE ? (int)(N - t * TILE) : TILE;
        if (q != NULL) unpack_tile_portable(&w, t, q);
        for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
          const int mt = M - m0 < MT_MAX ? (int)(M - m0) : MT_MAX;
          float out[MT_MAX][TILE];
#ifdef PAGEDLM_VNNI
          if (fast != NULL) {
            __m512 acc[MT_MAX];
            fast(&w, t, &a, m0, mt, acc);
            for (int j = 0; j < mt; j++) _mm512_storeu_ps(out[j], acc[j]);
          } else
#elif defined(PAGEDLM_AVX2_INT8)
          if (fast != NULL)
            fast(&w, t, &a, m0, mt, out);
          else
#endif
            tile_dots_portable(&w, q, t, &a, m0, mt, out);
          for (int j = 0; j < mt; j++) store_out(y, ldy, bias, m0 + j, t * TILE, cols, out[j], bf16);
        }
      }
    }
    free(q);
  }
  free_act(&a);
  return ok;
}

// out[(n - n0) * K + k] = W[n][k] for n0 <= n < n1, bf16 or fp32, computed as
// (float)(q - offset) * scale, then - min: the PyTorch twin's operations, unfused.
__attribute__((optimize("fp-contract=off"))) int gguf_dequantize_rows(
    const uint8_t* qs, const uint8_t* qh, const void* scales, const void* mins,
    const float* sup, const float* msup, int64_t N, int64_t K, int bits, int group,
    int offset, int kind, int64_t n0, int64_t n1, void* out, int bf16, int num_threads) {
  const QWeight w = {qs, qh, scales, mins, sup, msup, N, K, bits, group, offset, kind};
  if (!valid(&w) || n0 < 0 || n1 > N || n0 >= n1) return 0;
  const int64_t t0 = n0 / TILE, t1 = (n1 + TILE - 1) / TILE;
  int ok = 1;
#pragma omp parallel num_threads(num_threads)
  {
    uint8_t* q = malloc(TILE * K);
    float* row = malloc(sizeof(float) * K);
    if (q == NULL || row == NULL) {
#pragma omp atomic write
      ok = 0;
    } else {
#pragma omp for schedule(static)
      for (int64_t t = t0; t < t1; t++) {
        unpack_tile_portable(&w, t, q);
        for (int r = 0; r < TILE; r++) {
          const int64_t n = t * TILE + r;
          if (n < n0 || n >= n1) continue;
          for (int64_t k = 0; k < K; k++) {
            const int64_t g = k / group;
            const float v = (float)((int32_t)q[r * K + k] - offset) * scale_of(&w, 0, t, g, r);
            row[k] = mins == NULL ? v : v - scale_of(&w, 1, t, g, r);
          }
          store_row(out, (n - n0) * K, K, bf16, row);
        }
      }
    }
    free(q);
    free(row);
  }
  return ok;
}

// Quantize x [M, K] per block of 32 or 256 values: q int8 [M, K], d fp32 [M, K / block].
// Returns 0 for another block or when out of memory.
int quantize_rows_q8(const void* x, int64_t M, int64_t K, int bf16, int64_t block, int8_t* q,
                     float* d) {
  if ((block != 32 && block != 128 && block != 256) || K % block) return 0;
  float* buf = malloc(sizeof(float) * K);
  if (buf == NULL) return 0;
  for (int64_t m = 0; m < M; m++)
    quantize_row(x, m, K, bf16, block, q + m * K, d + m * (K / block), NULL, buf);
  free(buf);
  return 1;
}
