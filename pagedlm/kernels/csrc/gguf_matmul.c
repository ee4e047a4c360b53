// y[M, N] = x[M, K] . W[N, K]^T with W kept quantized (GGUF types repacked at load; layout in
// pagedlm/layers/quantization/gguf_pack.py):
//
//   W[n][k] = scale[n][k / G] * (q[n][k] - offset) - min[n][k / G]      (min optional)
//
// q is unsigned, `bits` wide (4, 5, 6 or 8), stored per 64-value chunk as a nibble plane (32
// bytes: byte i = q[i] & 15 | (q[32 + i] & 15) << 4) plus bits - 4 one-bit planes of 8 bytes
// (bit i of plane j = bit 4 + j of q[i]); 8-bit q is stored as 64 plain bytes instead.
//
// Decode (`gguf_gemv`): x is quantized per row and 32-value block to int8 (d = amax / 127,
// q = round-half-even(x * 127 / amax), as llama.cpp's Q8_0 does); each weight row is unpacked
// once into an L1 buffer of bytes and per-4-value scales, then vpdpbusd (AVX-512 VNNI) forms
// exact int32 sums of 4 products per lane, started from -offset * (sum of those 4 activation
// quants) so the offset is removed in integers; lanes are scaled by weight scale x activation
// scale in fp32. The min term is sum over sub-blocks of min * d * (sum of activation quants).
// The portable path does the same arithmetic lane by lane in plain C.
//
// Larger batches (`gguf_gemm`, gguf_gemm.c): the same activation quantization, weight tiles
// unpacked to int8 in VNNI order in a per-thread scratch, a register-blocked vpdpbusd GEMM.
//
// Without VNNI (`gguf_dequantize_rows`): rows of W dequantized exactly as the PyTorch twin does
// (fp32, no fused multiply-add), for a float GEMM on tiles.
//
// Shared pieces (weight descriptor, activation quantization, chunk unpacking): gguf_common.h.
#include <stdlib.h>

#include "gguf_common.h"

#define MT_MAX 8  // activation rows per pass


// ---------------------------------------------------------------------------------- helpers


// Row n of q as K unsigned bytes.
static void unpack_row_portable(const QWeight* w, int64_t n, uint8_t* restrict q) {
  const int64_t chunks = w->K / 64, ss = qs_stride(w), hs = qh_stride(w);
  for (int64_t c = 0; c < chunks; c++) {
    const uint8_t* qs = w->qs + (n * chunks + c) * ss;
    uint8_t* out = q + c * 64;
    if (w->bits == 8) {
      memcpy(out, qs, 64);
      continue;
    }
    for (int i = 0; i < 32; i++) {
      out[i] = qs[i] & 15;
      out[32 + i] = qs[i] >> 4;
    }
    for (int p = 0; p < w->bits - 4; p++) {
      const uint8_t* plane = w->qh + (n * chunks + c) * hs + 8 * p;
      for (int i = 0; i < 64; i++) out[i] |= ((plane[i / 8] >> (i % 8)) & 1) << (4 + p);
    }
  }
}

#ifdef PAGEDLM_VNNI
static void unpack_row_avx512(const QWeight* w, int64_t n, uint8_t* restrict q) {
  const int64_t chunks = w->K / 64, ss = qs_stride(w), hs = qh_stride(w);
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
  for (int64_t c = 0; c < chunks; c++) {
    const uint8_t* qs = w->qs + (n * chunks + c) * ss;
    __m512i v;
    if (w->bits == 8) {
      v = _mm512_loadu_si512(qs);
    } else {  // low half from the low nibbles, high half from the high nibbles
      const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)qs));
      v = _mm512_and_si512(_mm512_srlv_epi64(b, shifts), low4);
      for (int p = 0; p < w->bits - 4; p++) {
        uint64_t bits;
        memcpy(&bits, w->qh + (n * chunks + c) * hs + 8 * p, 8);
        const __m512i hi = _mm512_maskz_mov_epi8(_cvtu64_mask64(bits),
                                                 _mm512_set1_epi8((char)(1 << (4 + p))));
        v = _mm512_or_si512(v, hi);
      }
    }
    _mm512_storeu_si512(q + c * 64, v);
  }
}
#endif

// Per-call activation data. Per (64-value chunk c, row m) one 192-byte tile, chunk-major so
// the rows of a pass sit at constant offsets from one pointer: 64 int8 quants, then per lane
// (4 values) the integer offset correction -offset * (sum of the 4 quants) and the activation
// scale d. With mins, d * (sum of quants) per weight sub-block, [M][K / G].
typedef struct {
  int8_t q[64];
  int32_t corr[16];
  float d[16];
} ActTile;

typedef struct {
  ActTile* tiles;  // [K / 64][M]
  float* sub_sum;  // [M][K / G] or NULL
  int64_t M;
} QAct;


// Quantize x [M, K] per 32-value block: q int8 [M, K], d fp32 [M, K / 32]. Returns 0 when out
// of memory.
int quantize_rows_q8(const void* x, int64_t M, int64_t K, int bf16, int8_t* q, float* d) {
  if (K % 32) return 0;
  float* buf = malloc(sizeof(float) * K);
  if (buf == NULL) return 0;
  for (int64_t m = 0; m < M; m++) quantize_row(x, m, K, bf16, q + m * K, d + m * (K / 32), buf);
  free(buf);
  return 1;
}

static int prepare_act(const void* x, int64_t M, const QWeight* w, int bf16, QAct* a) {
  const int64_t K = w->K, chunks = K / 64, subs = K / w->group;
  a->M = M;
  a->tiles = aligned_alloc(64, sizeof(ActTile) * chunks * M);
  a->sub_sum = w->mins != NULL ? malloc(sizeof(float) * M * subs) : NULL;
  int8_t* q = malloc(K);
  float* d = malloc(sizeof(float) * (K / 32));
  float* buf = malloc(sizeof(float) * K);
  const int ok = a->tiles && q && d && buf && (w->mins == NULL || a->sub_sum);
  for (int64_t m = 0; ok && m < M; m++) {
    quantize_row(x, m, K, bf16, q, d, buf);
    for (int64_t c = 0; c < chunks; c++) {
      ActTile* t = a->tiles + c * M + m;
      memcpy(t->q, q + 64 * c, 64);
      for (int l = 0; l < 16; l++) {
        const int8_t* v = t->q + 4 * l;
        t->corr[l] = -w->offset * (v[0] + v[1] + v[2] + v[3]);
        t->d[l] = d[2 * c + l / 8];
      }
    }
    for (int64_t s = 0; a->sub_sum != NULL && s < subs; s++) {
      int32_t total = 0;
      for (int i = 0; i < w->group; i++) total += q[s * w->group + i];
      a->sub_sum[m * subs + s] = d[(s * w->group) >> 5] * (float)total;
    }
  }
  free(q);
  free(d);
  free(buf);
  return ok;
}

static void free_act(QAct* a) {
  free(a->tiles);
  free(a->sub_sum);
}

// -------------------------------------------------------------------------------- row dots

// sum over chunks of lane-scaled exact int32 lane sums, for activation rows m0 .. m0 + mt - 1
// (wl: this weight row's scale per lane).
static void row_dots_portable(const uint8_t* wq, const float* wl, const QAct* a, int64_t m0,
                              int mt, int64_t K, float* out) {
  for (int j = 0; j < mt; j++) {
    float acc[16] = {0};
    for (int64_t c = 0; c < K / 64; c++) {
      const ActTile* t = a->tiles + c * a->M + m0 + j;
      for (int l = 0; l < 16; l++) {
        int32_t s = t->corr[l];
        for (int i = 0; i < 4; i++) s += (int32_t)wq[64 * c + 4 * l + i] * (int32_t)t->q[4 * l + i];
        acc[l] += (float)s * (wl[16 * c + l] * t->d[l]);
      }
    }
    float total = 0.f;
    for (int l = 0; l < 16; l++) total += acc[l];
    out[j] = total;
  }
}


#ifdef PAGEDLM_VNNI
// Decode fast path: ROWS_MAX weight rows at once, each chunk unpacked in registers (BITS a
// compile-time constant) and used against every activation row of the pass, whose tile is
// loaded once for all weight rows. out[r * mt + j] = dot of weight row n0 + r, act row m0 + j.
#define ROWS_MAX 4
#define PREFETCH_ROWS 8


static inline __attribute__((always_inline)) void fused_dots(const QWeight* w, int64_t n0,
                                                             const int NR, const QAct* a,
                                                             int64_t m0, const int MT,
                                                             const int BITS, float* out) {
  const int64_t subs = w->K / w->group;
  const int per_chunk = 64 / w->group;
  const __m512i spread = w->group == 32
                             ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                             : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __mmask16 smask = (__mmask16)((1u << per_chunk) - 1);
  __m512 acc[ROWS_MAX][MT_MAX];
  for (int r = 0; r < NR; r++)
    for (int j = 0; j < MT; j++) acc[r][j] = _mm512_setzero_ps();
  const ActTile* t = a->tiles + m0;
  for (int64_t c = 0; c < w->K / 64; c++, t += a->M) {
    __m512i wv[ROWS_MAX];
    __m512 ws[ROWS_MAX];
    for (int r = 0; r < NR; r++) {
      if (n0 + r + PREFETCH_ROWS < w->N) {  // the same chunk PREFETCH_ROWS rows ahead
        const int64_t ahead = (n0 + r + PREFETCH_ROWS) * (w->K / 64) + c;
        _mm_prefetch((const char*)(w->qs + ahead * (BITS == 8 ? 64 : 32)), _MM_HINT_T0);
        if (BITS == 5 || BITS == 6)
          _mm_prefetch((const char*)(w->qh + ahead * 8 * (BITS - 4)), _MM_HINT_T0);
        if ((c & 7) == 0)
          _mm_prefetch((const char*)(w->scales + (n0 + r + PREFETCH_ROWS) * subs + per_chunk * c),
                       _MM_HINT_T0);
      }
      wv[r] = unpack_chunk(w, n0 + r, c, BITS);
      const float* sc = w->scales + (n0 + r) * subs + per_chunk * c;
      ws[r] = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(smask, sc));
    }
    for (int j = 0; j < MT; j++) {
      const __m512i corr = _mm512_load_si512(t[j].corr);
      const __m512i xq = _mm512_load_si512(t[j].q);
      const __m512 d = _mm512_load_ps(t[j].d);
      for (int r = 0; r < NR; r++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, wv[r], xq));
        acc[r][j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws[r], d), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < NR; r++)
    for (int j = 0; j < MT; j++) out[r * MT + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// 4 rows x 1-4 activation rows, or 1-4 rows x 5-8 (2 rows) / any (1 row).
#define FUSED_FOR_BITS(BITS)                                                                  \
  static void fused_b##BITS(const QWeight* w, int64_t n0, int nr, const QAct* a, int64_t m0, \
                            int mt, float* out) {                                             \
    if (nr == 4 && mt == 1) fused_dots(w, n0, 4, a, m0, 1, BITS, out);                        \
    else if (nr == 4 && mt == 2) fused_dots(w, n0, 4, a, m0, 2, BITS, out);                   \
    else if (nr == 4 && mt == 3) fused_dots(w, n0, 4, a, m0, 3, BITS, out);                   \
    else if (nr == 4 && mt == 4) fused_dots(w, n0, 4, a, m0, 4, BITS, out);                   \
    else if (nr == 2 && mt == 8) fused_dots(w, n0, 2, a, m0, 8, BITS, out);                   \
    else                                                                                      \
      for (int r = 0; r < nr; r++) fused_dots(w, n0 + r, 1, a, m0, mt < 8 ? mt : 8, BITS,     \
                                              out + r * mt);                                  \
  }
FUSED_FOR_BITS(4)
FUSED_FOR_BITS(5)
FUSED_FOR_BITS(6)
FUSED_FOR_BITS(8)

static void fused(const QWeight* w, int64_t n0, int nr, const QAct* a, int64_t m0, int mt,
                  float* out) {
  switch (w->bits) {
    case 4: fused_b4(w, n0, nr, a, m0, mt, out); break;
    case 5: fused_b5(w, n0, nr, a, m0, mt, out); break;
    case 6: fused_b6(w, n0, nr, a, m0, mt, out); break;
    default: fused_b8(w, n0, nr, a, m0, mt, out);
  }
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

// y [M, N] (bf16 or fp32, as x) = x W^T (+ bias, in x's dtype). isa: 1 = AVX-512 VNNI,
// 0 = portable. Returns 1 if computed; 0 for bad arguments, an ISA not compiled in, or out of
// memory.
int gguf_gemv(const void* x, const uint8_t* qs, const uint8_t* qh, const float* scales,
              const float* mins, const void* bias, void* y, int64_t M, int64_t N, int64_t K,
              int bits, int group, int offset, int bf16, int isa, int num_threads) {
  const QWeight w = {qs, qh, scales, mins, N, K, bits, group, offset};
  if (!valid(&w) || M < 1) return 0;
#ifndef PAGEDLM_VNNI
  if (isa == 1) return 0;
#endif
  QAct a = {NULL, NULL, M};
  if (!prepare_act(x, M, &w, bf16, &a)) {
    free_act(&a);
    return 0;
  }
  const int64_t lanes = K / 4, subs = K / group;
  int ok = 1;
#pragma omp parallel num_threads(num_threads)
  {
    uint8_t* wq = aligned_alloc(64, K);
    float* wl = aligned_alloc(64, sizeof(float) * lanes);
    if (wq == NULL || wl == NULL) {
#pragma omp atomic write
      ok = 0;
    } else {
#pragma omp for schedule(static)
      for (int64_t nb = 0; nb < (N + 3) / 4; nb++) {
        const int64_t n0 = 4 * nb;
        const int nr = N - n0 < 4 ? (int)(N - n0) : 4;
        // pass widths: 4 activation rows with 4 weight rows, else 8 with 2 (or 1)
        const int width = M <= 4 ? 4 : 8;
        for (int64_t m0 = 0; m0 < M; m0 += width) {
          const int mt = M - m0 < width ? (int)(M - m0) : width;
          float dots[4 * MT_MAX];
#ifdef PAGEDLM_VNNI
          if (isa == 1) {
            if (mt <= 4) {
              fused(&w, n0, nr, &a, m0, mt, dots);
            } else {
              for (int r = 0; r < nr; r += 2) {
                const int pair = nr - r < 2 ? nr - r : 2;
                if (pair == 2 && mt == 8) {
                  fused(&w, n0 + r, 2, &a, m0, 8, dots + r * mt);
                } else {
                  fused(&w, n0 + r, pair, &a, m0, mt, dots + r * mt);
                }
              }
            }
          } else
#endif
          {
            for (int r = 0; r < nr; r++) {
              unpack_row_portable(&w, n0 + r, wq);
              const float* sc = scales + (n0 + r) * subs;
              const int per = group / 4;  // lanes per sub-block
              for (int64_t sb = 0; sb < subs; sb++)
                for (int i = 0; i < per; i++) wl[sb * per + i] = sc[sb];
              row_dots_portable(wq, wl, &a, m0, mt, K, dots + r * mt);
            }
          }
          for (int r = 0; r < nr; r++) {
            const int64_t n = n0 + r;
            float bv = 0.f;
            if (bias != NULL) load_row(bias, n, 1, bf16, &bv);
            for (int j = 0; j < mt; j++) {
              float v = dots[r * mt + j];
              if (mins != NULL) {
                const float* mn = mins + n * subs;
                const float* ss = a.sub_sum + (m0 + j) * subs;
                float t = 0.f;
#pragma omp simd reduction(+ : t)
                for (int64_t s = 0; s < subs; s++) t += mn[s] * ss[s];
                v -= t;
              }
              v += bv;
              const int64_t at = (m0 + j) * N + n;
              if (bf16)
                ((uint16_t*)y)[at] = to_bf16(v);
              else
                ((float*)y)[at] = v;
            }
          }
        }
      }
    }
    free(wq);
    free(wl);
  }
  free_act(&a);
  return ok;
}

#ifdef PAGEDLM_VNNI
// Row n of W into out at `at` (bf16 or fp32), 16 values per step: (float)(q - offset) * scale,
// then - min, unfused as in the PyTorch twin. Returns 1 (0: group size not handled here).
__attribute__((optimize("fp-contract=off"))) static int dequantize_row_avx512(
    const QWeight* w, int64_t n, void* out, int64_t at, int bf16) {
  const int64_t subs = w->K / w->group;
  const float* sc = w->scales + n * subs;
  const float* mn = w->mins == NULL ? NULL : w->mins + n * subs;
  const __m512i offset = _mm512_set1_epi32(w->offset);
  for (int64_t c = 0; c < w->K / 64; c++) {
    __m512i v;
    switch (w->bits) {
      case 4: v = unpack_chunk(w, n, c, 4); break;
      case 5: v = unpack_chunk(w, n, c, 5); break;
      case 6: v = unpack_chunk(w, n, c, 6); break;
      default: v = unpack_chunk(w, n, c, 8);
    }
    uint8_t bytes[64];
    _mm512_storeu_si512(bytes, v);
    for (int i = 0; i < 4; i++) {  // 16 values; a sub-block (16 or 32) never straddles them
      const int64_t k = 64 * c + 16 * i;
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(bytes + 16 * i)));
      const int64_t sb = k / w->group;
      __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, offset)),
                               _mm512_set1_ps(sc[sb]));
      if (mn != NULL) x = _mm512_sub_ps(x, _mm512_set1_ps(mn[sb]));
      store16(out, at + k, x, bf16);
    }
  }
  return 1;
}
#endif

// out[(n - n0) * K + k] = W[n][k] for n0 <= n < n1, bf16 or fp32, computed as
// (float)(q - offset) * scale, then - min: the PyTorch twin's operations, unfused.
__attribute__((optimize("fp-contract=off"))) int gguf_dequantize_rows(
    const uint8_t* qs, const uint8_t* qh, const float* scales, const float* mins, int64_t N,
    int64_t K, int bits, int group, int offset, int64_t n0, int64_t n1, void* out, int bf16,
    int num_threads) {
  const QWeight w = {qs, qh, scales, mins, N, K, bits, group, offset};
  if (!valid(&w) || n0 < 0 || n1 > N || n0 >= n1) return 0;
  int ok = 1;
#pragma omp parallel num_threads(num_threads)
  {
    uint8_t* q = malloc(K);
    float* row = malloc(sizeof(float) * K);
    if (q == NULL || row == NULL) {
#pragma omp atomic write
      ok = 0;
    } else {
#pragma omp for schedule(static)
      for (int64_t n = n0; n < n1; n++) {
#ifdef PAGEDLM_VNNI
        if (dequantize_row_avx512(&w, n, out, (n - n0) * K, bf16)) continue;
        unpack_row_avx512(&w, n, q);
#else
        unpack_row_portable(&w, n, q);
#endif
        const float* sc = scales + n * (K / group);
        const float* mn = mins == NULL ? NULL : mins + n * (K / group);
        for (int64_t sb = 0; sb < K / group; sb++)
          for (int i = 0; i < group; i++) {
            const int64_t k = sb * group + i;
            const float v = (float)((int32_t)q[k] - offset) * sc[sb];
            row[k] = mn == NULL ? v : v - mn[sb];
          }
        store_row(out, (n - n0) * K, K, bf16, row);
      }
    }
    free(q);
    free(row);
  }
  return ok;
}
