// The AMX inner path of paged_prefill.c: the BF16 path's packing and softmax
// (paged_prefill_bf16.h), with the scores and the weighted values as AMX tile products, 32
// rows at a time (two A tiles against each B tile). The packed keys ([head_size / 2][KP] bf16
// pairs, KT used) are B tiles as they lie (16 dim pairs x 16 keys, rows KP * 4 bytes apart), the packed
// values ([KT / 2][head_size][2]) too (16 key pairs x 16 dims), the raw bf16 query rows and the
// bf16 probability rows A tiles.
// Exact bf16 products and fp32 sums, as the BF16 path's dot products. Defines
// PAGEDLM_PREFILL_AMX where the CPU has AMX-BF16.
//
// Per 16 rows x 256 keys, AVX-512 BF16 spent ~2500 cycles on each product; these are 32 tile
// products each. At head size 128 the packed keys and values (64 KB each) come from L2; with
// one A tile per block each B tile served one product and the block ran at ~800 GFLOP/s on 2
// Sapphire Rapids cores, with two ~930 (one layer timed alone; an 8 x 4096 prefill of the
// 1.5B in the engine: 45.1 -> 44.3 s). Packing each tile once per call instead of once per
// work item was faster timed alone and gained nothing in the engine.
#pragma once
#include "paged_prefill_bf16.h"

#if defined(PAGEDLM_PREFILL_BF16) && defined(PAGEDLM_AMX)
#define PAGEDLM_PREFILL_AMX 1

// Tiles 0-3: sums (rows 0-15 in 0, 1 and rows 16-31 in 2, 3; 16 keys or 16 dims each), 4, 5:
// A (rows 0-15, 16-31), 6, 7: B.
static inline void prefill_amx_configure(void) { amx_configure_full_tiles(8); }

// p[r][0 .. kn) = q_r . k_j for the block's 32 rows (qb: raw bf16 queries, d / 2 pairs a
// row): per 32 keys four C tiles, each dim step two query A tiles against two key B tiles.
static inline __attribute__((always_inline)) void qk_amx(const uint32_t* qb, const uint32_t* kp,
                                                         float* p, const int DV, int kn) {
  const int64_t dp = 8 * DV;  // pairs per row
  for (int kg = 0; kg < kn; kg += 32) {  // kn is a multiple of 32
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < DV / 2; c++) {  // 32 dims a step
      const uint32_t* k = kp + 16 * c * KP + kg;
      _tile_loadd(4, qb + 16 * c, dp * 4);
      _tile_loadd(6, k, KP * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, qb + 16 * dp + 16 * c, dp * 4);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, k + 16, KP * 4);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, p + kg, KP * 4);
    _tile_stored(1, p + kg + 16, KP * 4);
    _tile_stored(2, p + 16 * KP + kg, KP * 4);
    _tile_stored(3, p + 16 * KP + kg + 16, KP * 4);
  }
}

// Rows rb .. rb + 31: acc = acc * alpha + P . V over keys 0 .. kn - 1 (probabilities as bf16
// rows in pb, values packed in vp), 32 dims (four C tiles) at a time.
static inline __attribute__((always_inline)) void pv_amx(Scratch* s, const uint16_t* vp,
                                                         int64_t rb, const int DV, int kn) {
  const int64_t d = 16 * DV;
  for (int64_t r = rb; r < rb + RB_AMX; r++) {
    const float al = s->alpha[r];
    if (al == 1.f) continue;
    for (int c = 0; c < DV; c++) {
      float* a = s->acc + r * d + 16 * c;
      _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_set1_ps(al)));
    }
  }
  float* acc = s->acc + rb * d;
  const uint16_t* pb = (const uint16_t*)s->pb;
  for (int64_t d0 = 0; d0 < d; d0 += 32) {
    _tile_loadd(0, acc + d0, d * 4);
    _tile_loadd(1, acc + d0 + 16, d * 4);
    _tile_loadd(2, acc + 16 * d + d0, d * 4);
    _tile_loadd(3, acc + 16 * d + d0 + 16, d * 4);
    for (int kg = 0; kg < kn; kg += 32) {
      const uint16_t* v = vp + (kg / 2 * d + d0) * 2;  // key pairs kg / 2 .., dims d0 ..
      _tile_loadd(4, pb + kg, PBP * 2);  // rows of PBP bf16
      _tile_loadd(6, v, d * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, pb + 16 * PBP + kg, PBP * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, v + 32, d * 4);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc + d0, d * 4);
    _tile_stored(1, acc + d0 + 16, d * 4);
    _tile_stored(2, acc + 16 * d + d0, d * 4);
    _tile_stored(3, acc + 16 * d + d0 + 16, d * 4);
  }
}
#endif
