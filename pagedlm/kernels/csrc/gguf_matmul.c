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
// Prefill (`gguf_dequantize_rows`): rows of W dequantized exactly as the PyTorch twin does
// (fp32, no fused multiply-add), for a GEMM on tiles.
#include <stdlib.h>

#include "common.h"

#define MT_MAX 8  // activation rows per pass

typedef struct {
  const uint8_t* qs;     // [N][K / 64][32] nibble planes, or [N][K / 64][64] bytes (8 bits)
  const uint8_t* qh;     // [N][K / 64][8 * (bits - 4)] bit planes (5 and 6 bits), else NULL
  const float* scales;   // [N][K / G]
  const float* mins;     // [N][K / G] or NULL
  int64_t N, K;
  int bits, group, offset;
} QWeight;

// ---------------------------------------------------------------------------------- helpers

static inline int64_t qs_stride(const QWeight* w) { return w->bits == 8 ? 64 : 32; }

static inline int64_t qh_stride(const QWeight* w) {
  return w->bits == 5 || w->bits == 6 ? 8 * (w->bits - 4) : 0;
}

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

#if defined(PAGEDLM_AVX512) && defined(__AVX512VNNI__)
#define PAGEDLM_VNNI 1
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

// x row (bf16 or fp32) -> int8 per 32-block; d[b] = amax / 127.
static void quantize_row(const void* x, int64_t m, int64_t K, int bf16, int8_t* restrict q,
                         float* restrict d, float* restrict buf) {
  load_row(x, m * K, K, bf16, buf);
  for (int64_t b = 0; b < K / 32; b++) {
    const float* v = buf + 32 * b;
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    for (int i = 0; i < 32; i++) q[32 * b + i] = (int8_t)nearbyintf(v[i] * inv);
  }
}

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
// As row_dots_portable, with the weight scales of chunk c expanded to lanes in registers
// (sc: this row's scales; 2 per chunk for G = 32, 4 for G = 16).
static inline __attribute__((always_inline)) void row_dots_vnni_mt(const uint8_t* wq,
                                                                   const float* sc, int group,
                                                                   const QAct* a, int64_t m0,
                                                                   const int mt, int64_t K,
                                                                   float* out) {
  const int per_chunk = 64 / group;
  const __m512i spread = group == 32
                             ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                             : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __mmask16 smask = (__mmask16)((1u << per_chunk) - 1);
  __m512 acc[MT_MAX];
  for (int j = 0; j < mt; j++) acc[j] = _mm512_setzero_ps();
  const ActTile* t = a->tiles + m0;
  for (int64_t c = 0; c < K / 64; c++, t += a->M) {
    const __m512i w = _mm512_loadu_si512(wq + 64 * c);
    const __m512 ws =
        _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(smask, sc + per_chunk * c));
    for (int j = 0; j < mt; j++) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_load_si512(t[j].corr), w,
                                              _mm512_load_si512(t[j].q));
      const __m512 s = _mm512_mul_ps(ws, _mm512_load_ps(t[j].d));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[j]);
    }
  }
  for (int j = 0; j < mt; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}

static void row_dots_vnni(const uint8_t* wq, const float* sc, int group, const QAct* a,
                          int64_t m0, int mt, int64_t K, float* out) {
  switch (mt) {
    case 1: row_dots_vnni_mt(wq, sc, group, a, m0, 1, K, out); break;
    case 2: row_dots_vnni_mt(wq, sc, group, a, m0, 2, K, out); break;
    case 3: row_dots_vnni_mt(wq, sc, group, a, m0, 3, K, out); break;
    case 4: row_dots_vnni_mt(wq, sc, group, a, m0, 4, K, out); break;
    case 5: row_dots_vnni_mt(wq, sc, group, a, m0, 5, K, out); break;
    case 6: row_dots_vnni_mt(wq, sc, group, a, m0, 6, K, out); break;
    case 7: row_dots_vnni_mt(wq, sc, group, a, m0, 7, K, out); break;
    default: row_dots_vnni_mt(wq, sc, group, a, m0, 8, K, out);
  }
}
#endif

// ---------------------------------------------------------------------------------- entries

static int valid(const QWeight* w) {
  const int bits_ok = w->bits == 4 || w->bits == 5 || w->bits == 6 || w->bits == 8;
  return bits_ok && (w->group == 16 || w->group == 32) && w->N > 0 && w->K > 0 &&
         w->K % 64 == 0;
}

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
      for (int64_t n = 0; n < N; n++) {
#ifdef PAGEDLM_VNNI
        if (isa == 1)
          unpack_row_avx512(&w, n, wq);
        else
#endif
          unpack_row_portable(&w, n, wq);
        const float* sc = scales + n * subs;
        if (isa == 0) {
          const int per = group / 4;  // lanes per sub-block
          for (int64_t sb = 0; sb < subs; sb++)
            for (int i = 0; i < per; i++) wl[sb * per + i] = sc[sb];
        }
        for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
          const int mt = M - m0 < MT_MAX ? (int)(M - m0) : MT_MAX;
          float dots[MT_MAX];
#ifdef PAGEDLM_VNNI
          if (isa == 1)
            row_dots_vnni(wq, sc, group, &a, m0, mt, K, dots);
          else
#endif
            row_dots_portable(wq, wl, &a, m0, mt, K, dots);
          for (int j = 0; j < mt; j++) {
            float v = dots[j];
            if (mins != NULL) {
              const float* mn = mins + n * subs;
              const float* ss = a.sub_sum + (m0 + j) * subs;
              float t = 0.f;
#pragma omp simd reduction(+ : t)
              for (int64_t s = 0; s < subs; s++) t += mn[s] * ss[s];
              v -= t;
            }
            if (bias != NULL) {
              float bv;
              load_row(bias, n, 1, bf16, &bv);
              v += bv;
            }
            const int64_t at = (m0 + j) * N + n;
            if (bf16)
              ((uint16_t*)y)[at] = to_bf16(v);
            else
              ((float*)y)[at] = v;
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
