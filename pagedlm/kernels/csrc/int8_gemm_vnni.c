// y[M, N] = x[M, K] . W[N, K]^T (+ bias) on AVX-512 VNNI, for int8 weights with one scale per
// output channel (pack_q8's tiles: q + 128 as unsigned bytes, 64-byte k-quad vectors of 16
// columns): int8_gemm_amx's twin where AMX-INT8 does not run (Zen 4 and 5, Ice Lake), with
// its arguments and activation blocks (the layer's: 128, 256, or K per token), so that both
// CPU families compute the same sums. gguf_gemm.c's VNNI GEMM, which these weights took
// before, scales every 32 values by the weight's block scale; one scale per channel leaves one
// float step per activation block instead (per 128 values: 2 float operations a row and 16
// columns against 32 vpdpbusd, where blocks of 32 took 9).
//
// 1. Each row is quantized per QB-value block (rounded as the AMX kernel and quantize_row round)
//    into panels of MR_ROWS rows: per panel [K / 4][MR_ROWS][4] bytes, so that one k-step's
//    row quads lie side by side for the microkernel's broadcasts; as[i][b] = amax / 127 and
//    corr[i][b] = 128 * (the block's quant sum), which undoes the + 128 of the weights.
// 2. Rows go in equal blocks whose quants fit in half of L2, quantized just before use;
//    threads split the block's pairs of weight tiles (32 output columns). A pair's K goes in
//    chunks (an activation block, at most CHUNK_VALUES) whose weights stay in L1 while every
//    panel of the block runs against them. The first panel prefetches into L2 the chunk that
//    comes next on this thread (the pair's next, or the thread's next pair's first): read from
//    memory by hardware prefetch alone, the first panel of each chunk waited on it (the 1.5B
//    decode step's gate_up at 32 rows 0.65 -> 0.77 int8 TOPS on Zen 4; ~3% at 512 rows).
// 3. The microkernel holds a panel's MR rows x 32 columns in 2 MR int32 sums started at -corr:
//    one vpdpbusd per 4 values, a row and 16 columns, exact (|sum| <= 255 * 127 * QB < 2^31).
//    After a block, acc[i][n] += as[i][b] * sum in fp32; after K's last block y = ws[n] * acc
//    (+ bias[n]), or the fused silu(gate) * up (int8_gemm_output.h). Within blocks longer than
//    a chunk (per token) the int32 sums wait in memory between chunks.
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "int8_gemm_output.h"

#ifdef PAGEDLM_VNNI
#define MR_ROWS 8                 // activation rows per panel (16 int32 sums in registers)
#define BLOCK_BYTES (512 * 1024)  // quantized rows per block, L2-resident
#define CHUNK_VALUES 512          // K per L1 weight chunk: 2 tiles x 512 x 16 = 16 KB
#define MAX_QB 66048              // 255 * 127 * QB < 2^31: the int32 sums stay exact

// A row block's quantized activations (rows i = 0 .. of the block).
typedef struct {
  int8_t* q;      // [panels][K / 4][MR_ROWS][4]
  float* as;      // [rows][K / QB]
  int32_t* corr;  // [rows][K / QB]
  int64_t K, QB;
} Panels;

// Row m of x -> block row i of a: per QB-value block the scale, then 16 quants at a time
// (rounded as quantize_row rounds), each of their 4 quads stored to its k-step of the panel.
static void quantize_panel_row(const void* x, int64_t m, int64_t i, int bf16, const Panels* a) {
  const int64_t K = a->K, QB = a->QB, nb = K / QB;
  int8_t* panel = a->q + (i / MR_ROWS) * K * MR_ROWS + (i % MR_ROWS) * 4;
  for (int64_t b = 0; b < nb; b++) {
    const float amax = block_amax(x, m * K + QB * b, QB, bf16);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = QB * b; k < QB * (b + 1); k += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, m * K + k, bf16), inv));
      sum = _mm512_add_epi32(sum, v);
      const __m128i q = _mm512_cvtsepi32_epi8(v);  // |v| <= 127: nothing saturates
      int8_t* at = panel + k * MR_ROWS;            // k-step k / 4 of the panel
      _mm_storeu_si32(at, q);
      _mm_storeu_si32(at + MR_ROWS * 4, _mm_bsrli_si128(q, 4));
      _mm_storeu_si32(at + MR_ROWS * 8, _mm_bsrli_si128(q, 8));
      _mm_storeu_si32(at + MR_ROWS * 12, _mm_bsrli_si128(q, 12));
    }
    a->as[i * nb + b] = amax / 127.f;
    a->corr[i * nb + b] = 128 * _mm512_reduce_add_epi32(sum);
  }
}

// sums[i][h] += the dots of panel rows i < MR (quads at q) with tile h of the pair (w0; w1
// when NT == 2) over values k0 .. k0 + kn - 1 (with NT == 1, sums[i][1] is left as it was);
// with pf != 0, each k-step's weight lines pf bytes on are prefetched into L2.
// The sums live in named registers, in a function of their own per shape: from an array, or
// inlined into its caller, gcc copies every sum once a k-step (a vmovdqa per vpdpbusd, and a
// spill; qkv's product at 32 rows 0.36 against 0.31 ms).
#define LOAD_ROW(i) __m512i c##i##0 = sums[i][0], c##i##1 = sums[i][1];
#define STORE_ROW(i)                    \
  if (i < MR) {                         \
    sums[i][0] = c##i##0;               \
    if (NT > 1) sums[i][1] = c##i##1;   \
  }
#define DOT_ROW(i)                                                             \
  if (i < MR) {                                                                \
    int32_t v;                                                                 \
    memcpy(&v, at + 4 * i, 4);                                                 \
    const __m512i av = _mm512_set1_epi32(v);                                   \
    c##i##0 = _mm512_dpbusd_epi32(c##i##0, b0, av);                            \
    if (NT > 1) c##i##1 = _mm512_dpbusd_epi32(c##i##1, b1, av);                \
  }
static inline __attribute__((always_inline)) void panel_dots(const int8_t* q, const uint8_t* w0,
                                                             const uint8_t* w1, int64_t k0,
                                                             int64_t kn, __m512i sums[][2],
                                                             int64_t pf, const int MR,
                                                             const int NT) {
  LOAD_ROW(0) LOAD_ROW(1) LOAD_ROW(2) LOAD_ROW(3) LOAD_ROW(4) LOAD_ROW(5) LOAD_ROW(6) LOAD_ROW(7)
  for (int64_t k = k0; k < k0 + kn; k += 4) {
    const __m512i b0 = _mm512_loadu_si512(w0 + k * 16);
    const __m512i b1 = NT > 1 ? _mm512_loadu_si512(w1 + k * 16) : b0;
    if (pf) {
      _mm_prefetch((const char*)(w0 + k * 16 + pf), _MM_HINT_T1);
      if (NT > 1) _mm_prefetch((const char*)(w1 + k * 16 + pf), _MM_HINT_T1);
    }
    const int8_t* at = q + k * MR_ROWS;
    DOT_ROW(0) DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4) DOT_ROW(5) DOT_ROW(6) DOT_ROW(7)
  }
  STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5) STORE_ROW(6)
  STORE_ROW(7)
}

typedef void (*Dots)(const int8_t*, const uint8_t*, const uint8_t*, int64_t, int64_t,
                     __m512i[][2], int64_t);
#define DOTS(MR, NT)                                                                         \
  static __attribute__((noinline)) void dots_##MR##_##NT(const int8_t* q, const uint8_t* w0, \
                                                         const uint8_t* w1, int64_t k0,      \
                                                         int64_t kn, __m512i sums[][2],      \
                                                         int64_t pf) {                       \
    panel_dots(q, w0, w1, k0, kn, sums, pf, MR, NT);                                         \
  }
DOTS(1, 1) DOTS(2, 1) DOTS(3, 1) DOTS(4, 1) DOTS(5, 1) DOTS(6, 1) DOTS(7, 1) DOTS(8, 1)
DOTS(1, 2) DOTS(2, 2) DOTS(3, 2) DOTS(4, 2) DOTS(5, 2) DOTS(6, 2) DOTS(7, 2) DOTS(8, 2)
// panel_dots with MR rows (1 .. MR_ROWS) and NT tiles: DOTS_FOR[NT - 1][MR - 1]
static const Dots DOTS_FOR[2][MR_ROWS] = {
    {dots_1_1, dots_2_1, dots_3_1, dots_4_1, dots_5_1, dots_6_1, dots_7_1, dots_8_1},
    {dots_1_2, dots_2_2, dots_3_2, dots_4_2, dots_5_2, dots_6_2, dots_7_2, dots_8_2}};

// A pair's product on one row block, as a thread runs it: columns from n0, the per-thread
// acc (fp32, finished blocks) and sums (int32, the block in progress), [rows][32] each;
// `next`, the first tile of the pair this thread runs next (NULL: none).
typedef struct {
  const Panels* a;
  const Output* o;
  const uint8_t *w0, *w1, *next;
  int64_t mb, n0;
  int NT;
  float* acc;
  int32_t* sums;
  __m512 ws0, ws1, bias0, bias1;
} Pair;

// Panel rows i0 .. i0 + mr - 1 over values k0 .. k0 + kn - 1 of activation block b: the int32
// sums start at -corr on the block's first chunk (else from memory) and, after its last, go
// scaled into acc, or to y after K's last block.
static void panel_chunk(const Pair* p, int64_t i0, int mr, int64_t b, int64_t k0, int64_t kn) {
  const Panels* a = p->a;
  const int64_t nb = a->K / a->QB;
  const int first = k0 == b * a->QB, last = k0 + kn == (b + 1) * a->QB, NT = p->NT;
  __m512i s[MR_ROWS][2];
  for (int i = 0; i < mr; i++) {
    const int32_t* at = p->sums + (i0 + i) * 32;
    s[i][0] = first ? _mm512_set1_epi32(-a->corr[(i0 + i) * nb + b]) : _mm512_load_si512(at);
    s[i][1] = first ? s[i][0] : _mm512_load_si512(at + 16);
  }
  int64_t pf = 0;  // the first panel's prefetch: the next chunk, after K's last the next pair's
  if (i0 == 0) pf = k0 + kn < a->K ? kn * 16 : p->next ? p->next - p->w0 - k0 * 16 : 0;
  DOTS_FOR[NT - 1][mr - 1](a->q + i0 * a->K, p->w0, p->w1, k0, kn, s, pf);
  for (int i = 0; i < mr; i++) {
    if (!last) {
      _mm512_store_si512(p->sums + (i0 + i) * 32, s[i][0]);
      _mm512_store_si512(p->sums + (i0 + i) * 32 + 16, s[i][1]);
      continue;
    }
    float* acc = p->acc + (i0 + i) * 32;
    const __m512 d = _mm512_set1_ps(a->as[(i0 + i) * nb + b]);
    __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(s[i][0]), d);
    __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(s[i][1]), d);
    if (b > 0) {
      lo = _mm512_add_ps(lo, _mm512_load_ps(acc));
      hi = _mm512_add_ps(hi, _mm512_load_ps(acc + 16));
    }
    if (b + 1 < nb) {
      _mm512_store_ps(acc, lo);
      _mm512_store_ps(acc + 16, hi);
    } else if (NT > 1) {
      finish_pair_row(p->o, i0 + i, p->mb + i0 + i, p->n0, _mm512_fmadd_ps(lo, p->ws0, p->bias0),
                      _mm512_fmadd_ps(hi, p->ws1, p->bias1), 2);
    } else {
      finish_pair_row(p->o, i0 + i, p->mb + i0 + i, p->n0, _mm512_fmadd_ps(lo, p->ws0, p->bias0),
                      hi, 1);
    }
  }
}

// Weight tiles t0 (and t0 + 1 when NT == 2) against rows mb .. mb + rows - 1: K in chunks,
// every panel per chunk, so that a chunk's weights are read from memory once; `next`: the
// first tile of the thread's next pair, whose first chunk the last one prefetches (-1: none).
static void pair_product(const Panels* a, const uint8_t* qs, const Output* o, int64_t mb,
                         int64_t rows, int64_t t0, int64_t next, float* acc, int32_t* sums,
                         int NT) {
  const int64_t K = a->K, QB = a->QB, n0 = t0 * TILE;
  const uint8_t* w0 = qs + t0 * K * 16;  // tile t: K * 16 bytes from qs + t * K * 16
  Pair p = {a, o, w0, w0 + K * 16, next >= 0 ? qs + next * K * 16 : NULL, mb, n0, NT, acc, sums,
            _mm512_loadu_ps(o->ws + n0), _mm512_setzero_ps(), bias16(o, n0),
            _mm512_setzero_ps()};
  if (NT > 1) p.ws1 = _mm512_loadu_ps(o->ws + n0 + 16), p.bias1 = bias16(o, n0 + 16);
  for (int64_t b = 0; b < K / QB; b++) {
    for (int64_t k0 = b * QB; k0 < (b + 1) * QB; k0 += CHUNK_VALUES) {
      const int64_t kn = (b + 1) * QB - k0 < CHUNK_VALUES ? (b + 1) * QB - k0 : CHUNK_VALUES;
      for (int64_t i0 = 0; i0 < rows; i0 += MR_ROWS)
        panel_chunk(&p, i0, rows - i0 < MR_ROWS ? (int)(rows - i0) : MR_ROWS, b, k0, kn);
    }
  }
}
#endif

int int8_gemm_vnni_compiled(void) {
#ifdef PAGEDLM_VNNI
  return 1;
#else
  return 0;
#endif
}

// int8_gemm_amx's arguments and rules (int8_gemm_amx.c), with QB <= MAX_QB. Returns 1 if
// computed; 0 without AVX-512 VNNI, for shapes outside the rules, or when out of memory.
int int8_gemm_vnni(const void* x, const uint8_t* qs, const float* ws, const void* bias, void* y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t QB, int bf16,
                   int silu_and_mul, int num_threads) {
#ifdef PAGEDLM_VNNI
  if (!channel_gemm_shapes_ok(M, N, K, QB, ldy, silu_and_mul) || QB > MAX_QB) return 0;
  const int64_t tiles = (N + TILE - 1) / TILE, nb = K / QB;
  // equal blocks of whole panels, each at most BLOCK_BYTES of quants (or one panel)
  const int64_t panels = (M + MR_ROWS - 1) / MR_ROWS;
  const int64_t fit = BLOCK_BYTES / (MR_ROWS * K) > 1 ? BLOCK_BYTES / (MR_ROWS * K) : 1;
  const int64_t blocks = (panels + fit - 1) / fit;
  const int64_t rows_per_block = (panels + blocks - 1) / blocks * MR_ROWS;
  Panels a = {alloc_lines(rows_per_block * K), malloc(sizeof(float) * rows_per_block * nb),
              malloc(sizeof(int32_t) * rows_per_block * nb), K, QB};
  int ok = a.q != NULL && a.as != NULL && a.corr != NULL;
  const Output out = make_output(y, ws, bias, ldy, M, N, bf16, silu_and_mul);
  const int64_t units = out.up / 32;
  if (ok) {
#pragma omp parallel num_threads(num_threads)
    {
      float* acc = alloc_lines(rows_per_block * 32 * sizeof(float));
      int32_t* sums = alloc_lines(rows_per_block * 32 * sizeof(int32_t));
      Output o = out;
      if (out.up) o.gate = alloc_lines(rows_per_block * 32 * sizeof(float));
      const int have = acc != NULL && sums != NULL && (!out.up || o.gate);
      if (!have) {
#pragma omp atomic write
        ok = 0;
      }
      for (int64_t mb = 0; mb < M; mb += rows_per_block) {
        const int64_t rows = M - mb < rows_per_block ? M - mb : rows_per_block;
#pragma omp for schedule(static)
        for (int64_t m = mb; m < mb + rows; m++)
          if (have) quantize_panel_row(x, m, m - mb, bf16, &a);
        // pairs in the static schedule's order: a thread's next pair is the one after it
        if (out.up) {  // a gate pair, then its up pair on the same thread
#pragma omp for schedule(static)
          for (int64_t u = 0; u < units; u++) {
            if (!have) continue;
            pair_product(&a, qs, &o, mb, rows, 2 * u, 2 * (units + u), acc, sums, 2);
            pair_product(&a, qs, &o, mb, rows, 2 * (units + u), u + 1 < units ? 2 * (u + 1) : -1,
                         acc, sums, 2);
          }
        } else {
#pragma omp for schedule(static)
          for (int64_t t = 0; t < tiles; t += 2) {
            if (!have) continue;
            pair_product(&a, qs, &o, mb, rows, t, t + 2 < tiles ? t + 2 : -1, acc, sums,
                         t + 1 < tiles ? 2 : 1);
          }
        }
      }
      if (out.stream) _mm_sfence();  // the non-temporal stores land before y is read
      free(acc);
      free(sums);
      free(o.gate);
    }
  }
  free(a.q);
  free(a.as);
  free(a.corr);
  return ok;
#else
  (void)x, (void)qs, (void)ws, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K;
  (void)QB, (void)bf16, (void)silu_and_mul, (void)num_threads;
  return 0;
#endif
}
