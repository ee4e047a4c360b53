// Batched y[M, N] = x[M, K] . W[N, K]^T on packed GGUF weights (layout: gguf_matmul.c) in
// integer arithmetic, for prefill chunks and large decode batches (AVX-512 VNNI only; without
// it the caller dequantizes tiles for a float GEMM). Tiles and microkernels: gguf_gemm_micro.h.
//
// 1. x is quantized to int8 per row in blocks of QB values (the caller's act_block): for the
//    K-quants (Q4_K, Q5_K, Q6_K) 256 as ggml's Q8_K, so that a super-block's sub-blocks share
//    one activation scale and their dots combine in integers; for blocks of 32, 32 (as the
//    GEMV) or 128, which saves the per-sub-block float multiply by the activation scale.
// 2. W is cut into tile pairs of 32 output columns. A thread unpacks a pair into a scratch of
//    bytes in VNNI order (16 rows x 4 bytes per vector, as packed) plus its scales; 8-bit
//    quants of a full pair are read in place, not copied.
// 3. Rows are taken in blocks whose quantized activations fit in L2 next to the tile; with
//    enough rows the threads split the rows, else the tiles.
// 4. The microkernel holds MR activation rows x 32 columns: per sub-block, int32 accumulators
//    start at corr and take G / 4 vpdpbusd steps (weight quant u8 x activation quant s8,
//    exact); then the float scaling, per sub-block (blocks of 32) or per super-block.
// Every integer sum is exact in int32; with QB = 32 the float rounding of the blocks-of-32 path
// differs from the GEMV's only in summation order.
#include <omp.h>

#include "gguf_gemm_micro.h"

#ifdef PAGEDLM_VNNI
#define ACT_BLOCK_BYTES (384 * 1024)  // quantized activation rows per block (L2: 1 MiB)
#define SPLIT_ROWS 256  // rows per thread from which threads split rows, not tiles

static int is_kquant(const QWeight* w) {
  return w->kind == SCALES_I8_SUPER || w->kind == SCALES_U8_SUPER;
}

// Arrays of a for M rows (whole panels) in activation blocks of QB; 0 when out of memory
// (free_acts is still due).
static int alloc_acts(Acts* a, const QWeight* w, int64_t M, int64_t QB) {
  const int64_t subs = w->K / w->group;
  const int64_t slots = (M + MR_MAX - 1) / MR_MAX * MR_MAX;
  a->q = alloc_lines(slots * w->K);
  a->d = malloc(sizeof(float) * slots * (w->K / QB));
  a->corr = malloc(sizeof(int32_t) * slots * subs);
  a->sums = w->mins != NULL ? malloc(sizeof(int32_t) * slots * subs) : NULL;
  return a->q && a->d && a->corr && (w->mins == NULL || a->sums);
}

static void free_acts(Acts* a) {
  free(a->q);
  free(a->d);
  free(a->corr);
  free(a->sums);
}

// Row m of x into its panel slot of a; buf: act_scratch(K) floats + K bytes.
static void quantize_acts_row(const void* x, int64_t m, const QWeight* w, int bf16, int64_t QB,
                              const Acts* a, float* restrict buf) {
  const int64_t K = w->K, G = w->group, subs = K / G;
  const int64_t p = m / MR_MAX, i = m % MR_MAX;
  float* d = buf + K;  // [K / QB]
  int32_t* sums16 = (int32_t*)(buf + K + K / 32);
  int8_t* q = (int8_t*)(buf + act_scratch(K));
  quantize_row(x, m, K, bf16, QB, q, d, sums16, buf);
  int8_t* panel = a->q + p * K * MR_MAX;
  for (int64_t j = 0; j < K / 4; j++) memcpy(panel + (j * MR_MAX + i) * 4, q + 4 * j, 4);
  for (int64_t b = 0; b < K / QB; b++) a->d[(p * (K / QB) + b) * MR_MAX + i] = d[b];
  for (int64_t g = 0; g < subs; g++) {
    const int32_t total = sub_block_sum(sums16, g, G);
    const int64_t at = (p * subs + g) * MR_MAX + i;
    a->corr[at] = -w->offset * total;
    if (a->sums != NULL) a->sums[at] = total;
  }
}

// Per thread: the unpacked quads of one tile pair and its scales, as the microkernel reads them.
typedef struct {
  uint8_t* quads;      // [2][K / 4][64]: the quads of each tile, as packed
  void *scales, *mins;  // [K / G][32]: fp32 (blocks of 32) or int32 sub-scales (K-quants)
  float *sup, *msup;   // [K / 256][32]: K-quants' d and dmin
} Scratch;

static int alloc_scratch(Scratch* s, const QWeight* w) {
  const int64_t subs = w->K / w->group, kq = is_kquant(w);
  s->quads = alloc_lines(NT * w->K);
  s->scales = alloc_lines(4 * NT * subs);
  s->mins = w->mins != NULL ? alloc_lines(4 * NT * subs) : NULL;
  s->sup = kq ? alloc_lines(4 * NT * (w->K / 256)) : NULL;
  s->msup = kq && w->mins != NULL ? alloc_lines(4 * NT * (w->K / 256)) : NULL;
  return s->quads && s->scales && (w->mins == NULL || s->mins) && (!kq || s->sup) &&
         (!kq || w->mins == NULL || s->msup);
}

static void free_scratch(Scratch* s) {
  free(s->quads);
  free(s->scales);
  free(s->mins);
  free(s->sup);
  free(s->msup);
}

// Part `part` of `parts` of tile pair tp's packed bytes (quants, scales, mins) prefetched into
// L2, so that the next pair streams in while this one computes: the weights of a decode step
// come from DRAM (every step reads all of them, far more than L3 holds). always_inline: gcc
// removes calls of a function whose only effect is a prefetch.
static inline __attribute__((always_inline)) void prefetch_pair(const QWeight* w, int64_t tp,
                                                              int64_t part, int64_t parts) {
  if (tp < 0 || 2 * tp >= num_tiles(w)) return;
  const int64_t K = w->K, subs = K / w->group;
  const int64_t scale_bytes = w->kind == SCALES_F32 ? 4 : w->kind == SCALES_F16 ? 2 : 1;
  const struct {
    const void* base;
    int64_t per_tile;  // bytes
  } fields[] = {{w->qs, (w->bits == 8 ? K / 4 : K / 8) * 64},
                {w->qh, w->bits > 4 && w->bits < 8 ? K / 8 * 16 * (w->bits - 4) : 0},
                {w->scales, subs * TILE * scale_bytes},
                {w->mins, subs * TILE * scale_bytes},
                {w->sup, K / 256 * TILE * 4},
                {w->msup, K / 256 * TILE * 4}};
  const int64_t pair_tiles = 2 * tp + 1 < num_tiles(w) ? 2 : 1;
  for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++) {
    if (fields[f].base == NULL || fields[f].per_tile == 0) continue;
    const char* at = (const char*)fields[f].base + 2 * tp * fields[f].per_tile;
    const int64_t lines = (pair_tiles * fields[f].per_tile + 63) / 64;
    for (int64_t i = lines * part / parts; i < lines * (part + 1) / parts; i++)
      _mm_prefetch(at + 64 * i, _MM_HINT_T1);
  }
}

#define MICRO_FOR(NAME, KERNEL, ...)                                                          \
  static void NAME(Quads wq, const Scratch* s, const Acts* a, int64_t K, int64_t p, int mr,   \
                   float* out) {                                                              \
    switch (mr) {                                                                             \
      case 6: KERNEL(wq, __VA_ARGS__, a, K, p, 6, out); break;                               \
      case 5: KERNEL(wq, __VA_ARGS__, a, K, p, 5, out); break;                               \
      case 4: KERNEL(wq, __VA_ARGS__, a, K, p, 4, out); break;                               \
      case 3: KERNEL(wq, __VA_ARGS__, a, K, p, 3, out); break;                               \
      case 2: KERNEL(wq, __VA_ARGS__, a, K, p, 2, out); break;                               \
      default: KERNEL(wq, __VA_ARGS__, a, K, p, 1, out);                                     \
    }                                                                                         \
  }
#define FLOAT32(wq, G, QB, MINS, a, K, p, MR, out) \
  micro(wq, s->scales, s->mins, a, K, p, MR, G, QB, MINS, out)
#define INT256(wq, G, MINS, a, K, p, MR, out) \
  micro_k(wq, s->scales, s->mins, s->sup, s->msup, a, K, p, MR, G, MINS, out)
// The kinds gguf_pack.py makes: blocks of 32 without mins (Q4_0, Q5_0, Q8_0) and with them
// (Q4_1, Q5_1), activations in blocks of 32 or 128; K-quants with 16-value sub-blocks (Q6_K)
// and 32-value ones with mins (Q4_K, Q5_K).
MICRO_FOR(micro_f32_a32_m0, FLOAT32, 32, 32, 0)
MICRO_FOR(micro_f32_a32_m1, FLOAT32, 32, 32, 1)
MICRO_FOR(micro_f32_a128_m0, FLOAT32, 32, 128, 0)
MICRO_FOR(micro_f32_a128_m1, FLOAT32, 32, 128, 1)
MICRO_FOR(micro_k16_m0, INT256, 16, 0)
MICRO_FOR(micro_k32_m1, INT256, 32, 1)

typedef void (*Micro)(Quads, const Scratch*, const Acts*, int64_t, int64_t, int, float*);

// The microkernel for w with activations in blocks of QB, or NULL for a kind no packed type has
// or a QB it does not take (256 for the K-quants; 32 or 128 dividing K for blocks of 32).
static Micro micro_for(const QWeight* w, int64_t QB) {
  const int mins = w->mins != NULL;
  if (!is_kquant(w)) {
    if (w->group != 32 || w->K % QB != 0) return NULL;
    if (QB == 32) return mins ? micro_f32_a32_m1 : micro_f32_a32_m0;
    return QB == 128 ? (mins ? micro_f32_a128_m1 : micro_f32_a128_m0) : NULL;
  }
  if (QB != 256) return NULL;
  if (w->group == 16) return mins ? NULL : micro_k16_m0;
  return mins ? micro_k32_m1 : NULL;
}
#endif

int gguf_gemm_compiled(void) {
#ifdef PAGEDLM_VNNI
  return 1;
#else
  return 0;
#endif
}

// y [M, N] (bf16 or fp32, as x; rows ldy >= N elements apart) = x W^T (+ bias, in x's dtype),
// x quantized in blocks of act_block values. Returns 1 if computed; 0 for bad arguments (a
// kind without a microkernel, an act_block it does not take, included), no AVX-512 VNNI
// compiled in, or out of memory.
int gguf_gemm(const void* x, const uint8_t* qs, const uint8_t* qh, const void* scales,
              const void* mins, const float* sup, const float* msup, const void* bias, void* y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t act_block, int bits,
              int group, int offset, int kind, int bf16, int num_threads) {
#ifndef PAGEDLM_VNNI
  (void)x, (void)qs, (void)qh, (void)scales, (void)mins, (void)sup, (void)msup, (void)bias;
  (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)act_block, (void)bits, (void)group;
  (void)offset, (void)kind, (void)bf16, (void)num_threads;
  return 0;
#else
  const QWeight w = {qs, qh, scales, mins, sup, msup, N, K, bits, group, offset, kind};
  const Micro micro_kernel = valid(&w) ? micro_for(&w, act_block) : NULL;
  if (micro_kernel == NULL || M < 1 || ldy < N) return 0;
  const int64_t tiles = (N + NT - 1) / NT, elem = bf16 ? 2 : 4;
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
    Acts a = {0};
    Scratch s = {0};
    float* buf = malloc(sizeof(float) * act_scratch(K) + K);
    const int got_acts = alloc_acts(&a, &w, rows > 0 ? rows : 1, act_block);
    const int mine = alloc_scratch(&s, &w) && got_acts && buf != NULL;
    if (!mine) {
#pragma omp atomic write
      ok = 0;
    } else {
      for (int64_t m = 0; m < rows; m++) quantize_acts_row(xr, m, &w, bf16, act_block, &a, buf);
      for (int64_t b0 = 0; b0 < rows; b0 += block) {
        const int64_t b1 = rows - b0 < block ? rows : b0 + block;
        for (int64_t t = t0; t < t1; t++) {
          const int64_t n0 = t * NT;
          const int cols = N - n0 < NT ? (int)(N - n0) : NT;
          const Quads wq = unpack_quads_any(&w, t, s.quads);
          if (is_kquant(&w)) unpack_kscales(&w, t, s.scales, s.mins, s.sup, s.msup);
          else unpack_scales(&w, t, s.scales, s.mins);
          float bv[NT] = {0};
          if (bias != NULL) load_row(bias, n0, cols, bf16, bv);
          const __m512 bias0 = _mm512_loadu_ps(bv), bias1 = _mm512_loadu_ps(bv + 16);
          const __mmask16 lanes0 = lanes_below(cols), lanes1 = lanes_below(cols - 16);
          // the pair after this one: the next tile, or the first one again for the next block
          const int64_t next = t + 1 < t1 ? t + 1 : b1 < rows ? t0 : -1;
          const int64_t panels = (b1 - b0 + MR_MAX - 1) / MR_MAX;
          for (int64_t m0 = b0; m0 < b1; m0 += MR_MAX) {
            const int mr = b1 - m0 < MR_MAX ? (int)(b1 - m0) : MR_MAX;
            prefetch_pair(&w, next, (m0 - b0) / MR_MAX, panels);
            float out[MR_MAX * NT];
            micro_kernel(wq, &s, &a, K, m0 / MR_MAX, mr, out);
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
    free_acts(&a);
    free_scratch(&s);
    free(buf);
  }
  return ok;
#endif
}
