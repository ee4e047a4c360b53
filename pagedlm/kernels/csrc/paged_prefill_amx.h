// The AMX inner path of paged_prefill.c: the BF16 path's packing and softmax
// (paged_prefill_bf16.h), with the scores and the weighted values as AMX tile products, 16
// rows at a time. The packed keys ([head_size / 2][KT] bf16 pairs) are B tiles as they lie
// (16 dim pairs x 16 keys, rows KT * 4 bytes apart), the packed values ([KT / 2][head_size][2])
// too (16 key pairs x 16 dims), the raw bf16 query rows and the bf16 probability rows A tiles.
// Exact bf16 products and fp32 sums, as the BF16 path's dot products. Defines
// PAGEDLM_PREFILL_AMX where the CPU has AMX-BF16.
//
// Per 16 rows x 256 keys, AVX-512 BF16 spent ~2500 cycles on each product; these are 32 tile
// products each, and the softmax is most of what is left.
#pragma once
#include "paged_prefill_bf16.h"

#if defined(PAGEDLM_PREFILL_BF16) && defined(PAGEDLM_AMX)
#define PAGEDLM_PREFILL_AMX 1
#define RB_AMX 16  // rows per block: one tile's rows

// Tiles 0-3: sums (scores of 16 keys each, or 16 dims of the weighted values), 4: A, 5: B.
static inline void prefill_amx_configure(void) { amx_configure_full_tiles(6); }

// p[r][0 .. kn) = q_r . k_j for the block's 16 rows (qb: raw bf16 queries, d / 2 pairs a
// row): per 64 keys four C tiles, each dim step one query A tile against four key B tiles.
static inline __attribute__((always_inline)) void qk_amx(const uint32_t* qb, const uint32_t* kp,
                                                         float* p, const int DV, int kn) {
  const int64_t dp = 8 * DV;  // pairs per row
  for (int kg = 0; kg < kn; kg += 64) {
    const int groups = kn - kg >= 64 ? 4 : (kn - kg) / 16;  // kn is a multiple of 32
    _tile_zero(0);
    _tile_zero(1);
    if (groups > 2) _tile_zero(2);
    if (groups > 3) _tile_zero(3);
    for (int c = 0; c < DV / 2; c++) {  // 32 dims a step
      _tile_loadd(4, qb + 16 * c, dp * 4);
      const uint32_t* k = kp + 16 * c * KT + kg;
      _tile_loadd(5, k, KT * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, k + 16, KT * 4);
      _tile_dpbf16ps(1, 4, 5);
      if (groups > 2) {
        _tile_loadd(5, k + 32, KT * 4);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (groups > 3) {
        _tile_loadd(5, k + 48, KT * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, p + kg, KT * 4);
    _tile_stored(1, p + kg + 16, KT * 4);
    if (groups > 2) _tile_stored(2, p + kg + 32, KT * 4);
    if (groups > 3) _tile_stored(3, p + kg + 48, KT * 4);
  }
}

// Rows rb .. rb + 15: acc = acc * alpha + P . V over keys 0 .. kn - 1 (probabilities as bf16
// rows in pb, values packed in vp), 64 dims (four C tiles) at a time.
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
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    _tile_loadd(0, acc + d0, d * 4);
    _tile_loadd(1, acc + d0 + 16, d * 4);
    _tile_loadd(2, acc + d0 + 32, d * 4);
    _tile_loadd(3, acc + d0 + 48, d * 4);
    for (int kg = 0; kg < kn; kg += 32) {
      _tile_loadd(4, s->pb + kg / 2, KT * 2);  // rows of KT bf16
      const uint16_t* v = vp + (kg / 2 * d + d0) * 2;  // key pairs kg / 2 .., dims d0 ..
      _tile_loadd(5, v, d * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, v + 32, d * 4);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, v + 64, d * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, v + 96, d * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, acc + d0, d * 4);
    _tile_stored(1, acc + d0 + 16, d * 4);
    _tile_stored(2, acc + d0 + 32, d * 4);
    _tile_stored(3, acc + d0 + 48, d * 4);
  }
}
#endif
