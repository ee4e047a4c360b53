// y[M, N] = x[M, K] . W[N, K]^T (+ bias) on AMX-INT8, for int8 weights with one scale per
// output channel: the 8-bit tiles of gguf_pack.py (pack_q8), q + 128 as unsigned bytes, whose
// 64-byte k-quad vectors are, 16 at a time, exactly the B tiles of TDPBSUD (row j: 4 values of
// each of 16 columns). Prefill chunks and decode batches past the GEMV's of quantization="int8"
// and compressed-tensors W8A8 layers.
//
// 1. Every row of x is quantized to int8 per QB-value block (the caller's: the layer's
//    activation_block, 128 or 256, or K, per token as vLLM's W8A8): as[m][b] =
//    amax / 127, and corr[m][b] = 128 * (the block's sum of quants) undoes the + 128 of the
//    weights. The quants are laid out as the A tiles they become: per 32-row group and 64-value
//    k-step, 2 KB (rows 0-15, then 16-31), so each tile load reads 1 KB in a row.
// 2. Rows go in equal blocks whose quants fit in half of L2 (BLOCK_BYTES; 4096 x 9728 x 896 per
//    token with silu_and_mul: 21.5-22.6 ms in blocks of 1440 rows, 18-20 in blocks of 512-1024),
//    quantized just before use; threads split the block's pairs of weight tiles (32 output
//    columns). For a pair, K goes in chunks of CHUNK activation blocks whose weights (8 KB) stay in
//    L1 while every 32-row group of the block runs against them: per activation block four int32 C
//    tiles accumulate its QB values (exact) and are stored, then acc[m][n] += as[m][b] * C in fp32,
//    one pass over acc per chunk, from acc = -rc[m] = -sum over b of as[m][b] * corr[m][b] (C <
//    2^24 is exact in fp32 for QB <= 512; 7-14% faster per 128 than subtracting corr from every C).
//    Longer blocks subtract it in int32 first. After K's last block the sums go straight to y =
//    ws[n] * acc (+ bias[n]), a pair's row as one 64-byte line (bf16), and by non-temporal stores
//    where y passes 4 MiB: ordinary stores first read each line of y (strided rows, in no
//    prefetcher's pattern), which took ~30% of a 4096 x 17920 x 1536 product (70 -> 43 ms; 8 x 4096
//    prompts of the 1.5B int8: 38.5 -> 36.0 s).
//    Blocks longer than CHUNK_VALUES (per token) go in chunks of that many values, each
//    group's C tiles stored and reloaded between chunks, so the fp32 work comes once per
//    block (a cold 512 x 17920 x 1536 product: 3.4 TOPS per 128 values, 4.6 per token).
//    While a chunk's row groups run, a thread prefetches the weights of its next chunk a few
//    lines a k-step (NextWeights): before, each chunk's first group waited on memory for its
//    weights (the same product 5.1 -> 6.2 TOPS per token). With that, a pair whose whole
//    weight fits L1 (K <= 1024) no longer gains from running its row groups outer over all of
//    K (512 x 9728 x 896 per token 2.0 -> 1.7 ms in 512-value chunks), so none does.
//
// 3. silu_and_mul fused (gate_up of an MLP, W's rows [gate | up]): a thread takes a gate pair
//    and the up pair N / 2 columns on; the gate pair's scaled sums (rounded as y's dtype)
//    wait in a per-thread stash and the up pair writes silu(gate) * up, so the [M, N] product
//    is never written nor read back: bit for bit silu_and_mul of the unfused y. 512 x 17920
//    x 1536 (the 1.5B's gate_up) with silu_and_mul 7.0 -> 6.0 ms (5.2 with the prefetch); at
//    the 0.5B's K = 896, 2.78 -> 2.69 (2.1); the SiLU's vector work, ~18 cycles per 16
//    values, stays.
//
// On 2 Sapphire Rapids cores the tile products do not overlap the AVX-512 work (issuing the next
// group's products before this group's accumulation measured no faster), so the time is
// the TDPs plus the per-block fp32 accumulation: grouping blocks, keeping the chunk's weights
// in L1 and the block's quants in L2 took a cold 512 x 17920 x 1536 product from 2.6 to ~3.4
// TOPS, and a 32-row decode one from 1.6 to 1.25 ms (memory-bound: 1.1; benchmarks/gemm_micro.py).
// The tile products alone peak at 11.6 TOPS on the 2 cores, quants from L2 included (the
// 4-product step of step 2 in a loop), so per token the rest is still half of the time.
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_common.h"
#include "int8_gemm_output.h"

#define BLOCK_BYTES (1 << 20)   // quantized activation rows per block, L2-resident (of 2 MiB)
#define CHUNK 2                 // activation blocks per pass over acc (and per L1 weight chunk)
#define CHUNK_VALUES 512        // K per L1 weight chunk within longer activation blocks
#define PREFETCH_BYTES 2048     // weight bytes prefetched ahead of a lone row group's loads
#define SPREAD_GROUPS 4         // row groups in a block from which the next chunk is prefetched

#if defined(PAGEDLM_AMX) && defined(__AMX_INT8__)
#define PAGEDLM_AMX_INT8 1

// The A-tile layout of step 1: row m, values k .. k + 63 (k a multiple of 64).
static inline int8_t* packed_row(int8_t* aq, int64_t m, int64_t k, int64_t K) {
  return aq + (m / 32) * 32 * K + (k / 64) * 2048 + (m % 32) * 64;
}

// The weights a thread reads next (its pair's next K chunk, or its next pair's first),
// prefetched `per` lines a k-step while this chunk's row groups run: two tiles' `bytes` from
// tile[0] and tile[1] (step 2 above). Blocks of fewer than SPREAD_GROUPS groups, whose chunks
// are too short to hide a whole next chunk, prefetch PREFETCH_BYTES ahead of their loads
// instead.
typedef struct {
  const char* tile[2];
  int64_t bytes, at, per;
} NextWeights;

// Plan, for a chunk of values k .. k + kn - 1 of the pair at b0 (tiles b0, b0 + K * 16) run by
// `groups` row groups, the prefetch of the next `width` values: this pair's, or from K's end
// the first of `next` (the thread's next pair; NULL: none).
static inline void plan_next_weights(NextWeights* nw, const uint8_t* b0, const uint8_t* next,
                                     int64_t k, int64_t kn, int64_t width, int64_t K,
                                     int64_t groups) {
  const int64_t nk = k + kn < K ? k + kn : 0, steps = groups * (kn / 64);
  const uint8_t* w = nk ? b0 : next;
  nw->tile[0] = (const char*)w + nk * 16;
  nw->tile[1] = (const char*)w + (K + nk) * 16;
  nw->bytes = (K - nk < width ? K - nk : width) * 16;
  nw->at = 0;
  nw->per = groups < SPREAD_GROUPS || w == NULL ? 0 : (2 * nw->bytes / 64 + steps - 1) / steps;
}

static inline void prefetch_next_weights(NextWeights* nw) {
  for (int64_t j = 0; j < nw->per && nw->at < 2 * nw->bytes; j++, nw->at += 64) {
    const int t = nw->at >= nw->bytes;
    _mm_prefetch(nw->tile[t] + nw->at - t * nw->bytes, _MM_HINT_T0);
  }
}

// Row m of x (a block from row mb) -> its quants in the A-tile layout at row i = m - mb,
// as[i * nb + b], corr[i * nb + b] and rc[i] = sum over b of as * corr (the part of the sum
// of scaled block products that the + 128 of the weights adds).
static void quantize_packed(const void* x, int64_t m, int64_t mb, int64_t K, int64_t QB,
                            int bf16, int8_t* aq, float* as, int32_t* corr, float* rc) {
  const int64_t nb = K / QB, i0 = m - mb;
  float r = 0.f;
  for (int64_t b = 0; b < nb; b++) {
    const float amax = block_amax(x, m * K + QB * b, QB, bf16);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = QB * b; k < QB * (b + 1); k += 64) {  // one A-tile row of 64 quants
      __m128i q[4];
      for (int j = 0; j < 4; j++) {
        // |x * inv| <= 127: the saturating narrowing changes nothing
        const __m512 xv = load16(x, m * K + k + 16 * j, bf16);
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(xv, inv));
        sum = _mm512_add_epi32(sum, v);
        q[j] = _mm512_cvtsepi32_epi8(v);
      }
      const __m512i row = _mm512_inserti32x4(
          _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(q[0]), q[1], 1), q[2], 2),
          q[3], 3);
      _mm512_store_si512(packed_row(aq, i0, k, K), row);
    }
    as[i0 * nb + b] = amax / 127.f;
    corr[i0 * nb + b] = 128 * _mm512_reduce_add_epi32(sum);
    r += as[i0 * nb + b] * (float)corr[i0 * nb + b];
  }
  rc[i0] = r;
}

// C tiles 0, 1 (rows 0-15 of the group at `a`) and 2, 3 (rows 16-31) (+)= A . B over the kn
// values from k0 for weight tiles b0 (tile 6) and b1 (tile 7, when NT == 2); stored as 32 rows
// x 32 int32 at c, whence they start when `resume` (else from 0). Each k-step prefetches
// some of `nw`, or with `ahead` (and no plan) the weights PREFETCH_BYTES on.
static inline __attribute__((always_inline)) void block_product(const int8_t* a,
                                                                const uint8_t* b0,
                                                                const uint8_t* b1, int64_t k0,
                                                                int64_t kn, int32_t* c,
                                                                int resume, int ahead,
                                                                NextWeights* nw,
                                                                const int NT) {
  if (resume) {
    _tile_loadd(0, c, 128);
    _tile_loadd(2, c + 512, 128);
    if (NT > 1) _tile_loadd(1, c + 16, 128);
    if (NT > 1) _tile_loadd(3, c + 528, 128);
  } else {
    _tile_zero(0);
    _tile_zero(2);
    if (NT > 1) _tile_zero(1);
    if (NT > 1) _tile_zero(3);
  }
  for (int64_t k = k0; k < k0 + kn; k += 64) {
    if (nw->per)
      prefetch_next_weights(nw);
    else if (ahead)
      for (int l = 0; l < 1024; l += 64) {
        _mm_prefetch((const char*)b0 + k * 16 + PREFETCH_BYTES + l, _MM_HINT_T0);
        if (NT > 1) _mm_prefetch((const char*)b1 + k * 16 + PREFETCH_BYTES + l, _MM_HINT_T0);
      }
    _tile_loadd(4, a + k * 32, 64);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_loadd(5, a + k * 32 + 1024, 64);
    _tile_dpbsud(2, 5, 6);
    if (NT > 1) {
      _tile_loadd(7, b1 + k * 16, 64);
      _tile_dpbsud(1, 4, 7);
      _tile_dpbsud(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(2, c + 512, 128);
  if (NT > 1) _tile_stored(1, c + 16, 128);
  if (NT > 1) _tile_stored(3, c + 528, 128);
}

// acc rows 0 .. 31 (32 fp32 columns each) (+)= sum over g < nc of as[i][b + g] * (c[g] -
// corr[i][b + g]), i = i0 + row (rows of the block): with SUB as written, else as[] * c[g]
// from -rc[i] (`first`: acc starts there). On K's `last` chunk the sums go, scaled, to y rows
// mb + i below mend, columns from 16 t0, instead of to acc.
static inline __attribute__((always_inline)) void accumulate(
    const int32_t* c, int64_t nc, const float* as, const int32_t* corr, const float* rc,
    int64_t nb, int64_t b, int64_t i0, float* acc, int first, int last, const Output* o,
    int64_t mb, int64_t mend, int64_t t0, const int SUB, const int NT) {
  const int64_t n0 = t0 * TILE;
  __m512 w0 = _mm512_setzero_ps(), w1 = w0, b0 = w0, b1 = w0;
  if (last) {
    w0 = _mm512_loadu_ps(o->ws + n0), b0 = bias16(o, n0);
    if (NT > 1) w1 = _mm512_loadu_ps(o->ws + n0 + 16), b1 = bias16(o, n0 + 16);
  }
  for (int64_t r = 0; r < 32; r++) {
    const int64_t at = (i0 + r) * nb + b;
    const __m512 start = SUB ? _mm512_setzero_ps() : _mm512_set1_ps(-rc[i0 + r]);
    __m512 lo = first ? start : _mm512_load_ps(acc + 32 * r);
    __m512 hi = first || NT < 2 ? start : _mm512_load_ps(acc + 32 * r + 16);
    for (int64_t g = 0; g < nc; g++) {
      const int32_t* row = c + g * 1024 + 32 * r;
      const __m512 s = _mm512_set1_ps(as[at + g]);
      if (SUB) {
        const __m512i cr = _mm512_set1_epi32(corr[at + g]);
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(row), cr)),
                             s, lo);
        if (NT > 1)
          hi = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(row + 16), cr)), s, hi);
      } else {
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(row)), s, lo);
        if (NT > 1) hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(row + 16)), s, hi);
      }
    }
    if (!last) {
      _mm512_store_ps(acc + 32 * r, lo);
      if (NT > 1) _mm512_store_ps(acc + 32 * r + 16, hi);
    } else if (mb + i0 + r < mend) {
      finish_pair_row(o, i0 + r, mb + i0 + r, n0, _mm512_fmadd_ps(lo, w0, b0),
                      _mm512_fmadd_ps(hi, w1, b1), NT);
    }
  }
}

// Rows m0 .. m0 + 31 against weight tiles b0 (and b1): activation blocks b .. b + CHUNK - 1
// (fewer at K's end) into four int32 C tiles each, then summed into that group's acc (into y
// after K's last block).
static inline __attribute__((always_inline)) void group_chunk(
    const int8_t* aq, const float* as, const int32_t* corr, const float* rc, const uint8_t* b0,
    const uint8_t* b1, const Output* o, int64_t mb, int64_t mend, int64_t m0, int64_t t0,
    int64_t b, int64_t nb, int64_t K, int64_t QB, int32_t* c, float* acc, NextWeights* nw,
    const int NT) {
  const int64_t nc = nb - b < CHUNK ? nb - b : CHUNK;
  for (int64_t g = 0; g < nc; g++)
    block_product(aq + (m0 - mb) * K, b0, b1, (b + g) * QB, QB, c + g * 1024, 0, m0 == mb, nw,
                  NT);
  accumulate(c, nc, as, corr, rc, nb, b, m0 - mb, acc + (m0 - mb) * 32, b == 0, b + nc == nb, o,
             mb, mend, t0, 0, NT);
}

// Where an activation block is longer than a chunk (per token: QB = K), block b of rows mb ..
// mend - 1 in chunks of CHUNK_VALUES, every 32-row group per chunk; each group's int32 sums
// wait in `stash` (32 x 32 per group) between chunks and join acc (or y) after the block's last.
static inline __attribute__((always_inline)) void long_block(
    const int8_t* aq, const float* as, const int32_t* corr, const float* rc, const uint8_t* b0,
    const uint8_t* b1, const Output* o, int64_t mb, int64_t mend, int64_t t0, int64_t b,
    int64_t nb, int64_t K, int64_t QB, int32_t* stash, float* acc, const uint8_t* next,
    const int NT) {
  NextWeights nw;
  for (int64_t k0 = b * QB; k0 < (b + 1) * QB; k0 += CHUNK_VALUES) {
    const int64_t kn = (b + 1) * QB - k0 < CHUNK_VALUES ? (b + 1) * QB - k0 : CHUNK_VALUES;
    plan_next_weights(&nw, b0, next, k0, kn, CHUNK_VALUES, K, (mend - mb + 31) / 32);
    for (int64_t m0 = mb; m0 < mend; m0 += 32) {
      int32_t* c = stash + (m0 - mb) * 32;
      block_product(aq + (m0 - mb) * K, b0, b1, k0, kn, c, k0 > b * QB, m0 == mb, &nw, NT);
      if (k0 + kn == (b + 1) * QB)
        accumulate(c, 1, as, corr, rc, nb, b, m0 - mb, acc + (m0 - mb) * 32, b == 0, b + 1 == nb,
                   o, mb, mend, t0, 1, NT);
    }
  }
}

// One pair of weight tiles (t0, and t0 + 1 when NT == 2) against rows mb .. mend - 1 (a
// block): K in chunks of CHUNK activation blocks (or of CHUNK_VALUES within longer blocks),
// every 32-row group per chunk; each group's rows of y are written after its last chunk.
// `next`: the tile pair this thread computes next (NULL: none), whose weights are prefetched
// while the last chunk runs.
static inline __attribute__((always_inline)) void pair_product(
    const int8_t* aq, const float* as, const int32_t* corr, const float* rc, const uint8_t* qs,
    const Output* o, int64_t mb, int64_t mend, int64_t t0, const uint8_t* next, int64_t K,
    int64_t QB, int32_t* c, int32_t* stash, float* acc, const int NT) {
  const int64_t nb = K / QB, groups = (mend - mb + 31) / 32;
  const uint8_t* b0 = qs + t0 * (K / 4) * 64;
  const uint8_t* b1 = b0 + (K / 4) * 64;
  NextWeights nw;
  if (QB > CHUNK_VALUES) {
    for (int64_t b = 0; b < nb; b++)
      long_block(aq, as, corr, rc, b0, b1, o, mb, mend, t0, b, nb, K, QB, stash, acc, next, NT);
  } else {
    for (int64_t b = 0; b < nb; b += CHUNK) {
      const int64_t kn = (nb - b < CHUNK ? nb - b : CHUNK) * QB;
      plan_next_weights(&nw, b0, next, b * QB, kn, CHUNK * QB, K, groups);
      for (int64_t m0 = mb; m0 < mend; m0 += 32)
        group_chunk(aq, as, corr, rc, b0, b1, o, mb, mend, m0, t0, b, nb, K, QB, c, acc, &nw,
                    NT);
    }
  }
}
#endif

int int8_gemm_amx_supported(void) {
#ifdef PAGEDLM_AMX_INT8
  return amx_permitted();
#else
  return 0;
#endif
}

// x [M, K] bf16/fp32; qs [ceil(N / 16)][K / 4][64]; ws [ceil(N / 16) * 16] fp32 per-channel
// scales (padding rows 0); bias [N] in x's dtype or NULL; y rows ldy >= its width apart;
// activations in blocks of QB (a multiple of 64 dividing K). `silu_and_mul`: y [M, N / 2] =
// silu(gate) * up of the product [gate | up] (N a multiple of 64), which is never written.
// Returns 1 if computed; 0 without AMX-INT8, for shapes outside these rules, or when out of
// memory.
int int8_gemm_amx(const void* x, const uint8_t* qs, const float* ws, const void* bias, void* y,
                  int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t QB, int bf16,
                  int silu_and_mul, int num_threads) {
#ifdef PAGEDLM_AMX_INT8
  if (!channel_gemm_shapes_ok(M, N, K, QB, ldy, silu_and_mul) || !amx_permitted()) return 0;
  const int64_t tiles = (N + TILE - 1) / TILE, nb = K / QB, tile_bytes = K * 16;
  // blocks of equal 32-row groups, each at most BLOCK_BYTES of quants or SPREAD_GROUPS groups
  // (fewer would stream the weights from memory once too often for their products)
  const int64_t groups = (M + 31) / 32, fit = BLOCK_BYTES / (32 * K);
  const int64_t most = fit > SPREAD_GROUPS ? fit : SPREAD_GROUPS;  // groups in a block
  const int64_t blocks = (groups + most - 1) / most;
  const int64_t rows_per_block = (groups + blocks - 1) / blocks * 32;
  // one block's quants, scales and corrections, reused block by block (the rows of a last,
  // partial 32-row group past M hold zeros or an earlier block's rows: computed, never stored)
  int8_t* aq = alloc_lines(rows_per_block * K);
  float* as = calloc(rows_per_block * nb, sizeof(float));
  int32_t* corr = calloc(rows_per_block * nb, sizeof(int32_t));
  float* rc = calloc(rows_per_block, sizeof(float));
  int ok = aq != NULL && as != NULL && corr != NULL && rc != NULL;
  const Output out = make_output(y, ws, bias, ldy, M, N, bf16, silu_and_mul);
  const int64_t up = out.up, units = up / 32;
  if (ok) {
    memset(aq, 0, rows_per_block * K);
#pragma omp parallel num_threads(num_threads)
    {
      amx_configure_full_tiles(8);
      int32_t* c = alloc_lines(CHUNK * 1024 * sizeof(int32_t));
      float* acc = alloc_lines(rows_per_block * 32 * sizeof(float));
      int32_t* stash = QB > CHUNK_VALUES ? alloc_lines(rows_per_block * 32 * 4) : c;
      Output o = out;
      if (up) o.gate = alloc_lines(rows_per_block * 32 * sizeof(float));
      const int have = c != NULL && acc != NULL && stash != NULL && (!up || o.gate != NULL);
      if (!have) {
#pragma omp atomic write
        ok = 0;
      }
      for (int64_t mb = 0; mb < M; mb += rows_per_block) {
        const int64_t mend = mb + rows_per_block < M ? mb + rows_per_block : M;
#pragma omp for schedule(static)
        for (int64_t m = mb; m < mend; m++)
          quantize_packed(x, m, mb, K, QB, bf16, aq, as, corr, rc);
        if (up) {  // a gate pair, then its up pair on the same thread
#pragma omp for schedule(static)
          for (int64_t u = 0; u < units; u++) {
            if (!have) continue;
            const uint8_t* up_pair = qs + 2 * (units + u) * tile_bytes;
            const uint8_t* next_gate = u + 1 < units ? qs + 2 * (u + 1) * tile_bytes : NULL;
            pair_product(aq, as, corr, rc, qs, &o, mb, mend, 2 * u, up_pair, K, QB, c, stash,
                         acc, 2);
            pair_product(aq, as, corr, rc, qs, &o, mb, mend, 2 * (units + u), next_gate, K, QB,
                         c, stash, acc, 2);
          }
        } else {
#pragma omp for schedule(static)
          for (int64_t p = 0; p < (tiles + 1) / 2; p++) {
            if (!have) continue;
            const uint8_t* next = 2 * p + 2 < tiles ? qs + (2 * p + 2) * tile_bytes : NULL;
            if (2 * p + 1 < tiles)
              pair_product(aq, as, corr, rc, qs, &o, mb, mend, 2 * p, next, K, QB, c, stash, acc,
                           2);
            else
              pair_product(aq, as, corr, rc, qs, &o, mb, mend, 2 * p, next, K, QB, c, stash, acc,
                           1);
          }
        }
      }
      if (out.stream) _mm_sfence();  // the non-temporal stores land before y is read
      if (stash != c) free(stash);
      free(o.gate);
      free(c);
      free(acc);
      _tile_release();
    }
  }
  free(aq);
  free(as);
  free(corr);
  free(rc);
  return ok;
#else
  (void)x, (void)qs, (void)ws, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K;
  (void)QB, (void)bf16, (void)silu_and_mul, (void)num_threads;
  return 0;
#endif
}
