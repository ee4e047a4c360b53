// Per-item decode paths of paged_decode.c for AVX-512 (and AMX scores): the block walk with
// prefetching, scores across the heads of a kv group, softmax and weighted values.
#pragma once
#include "common.h"

typedef struct {
  int kind;  // the cache's element kind (KV_*)
  float k_scale, v_scale;
} KV;

// Head h (g within its kv head's group) of sequence b: into `out` (bf16 or fp32) when the
// sequence is not split, else into this split's fp32 partial rows, [group][head_size].
static inline void store_head(void* out, float* part, int64_t b, int64_t h, int64_t g,
                              int64_t num_heads, int64_t head_size, int bf16, const float* row) {
  if (part != NULL)
    memcpy(part + g * head_size, row, sizeof(float) * head_size);
  else
    store_row(out, (b * num_heads + h) * head_size, head_size, bf16, row);
}

#ifdef PAGEDLM_AVX512
// Walks the cache rows of tokens start .. start + n - 1 through the block table, with one
// division per walk rather than per token. Cache blocks sit anywhere in memory, so the hardware
// prefetcher stops at each block's end: entering a block prefetches all rows of the next one,
// into L2 rather than L1: the L1's few miss buffers held a decode step of 32 x 320 tokens
// (12/2 heads x 128, every layer's cache cold) to 9.7 GB/s, against 13.7 into L2 (Zen 4).
typedef struct {
  const char* cache;
  const int64_t* table;
  int64_t block_size, token_stride, head_offset, row_bytes, elem_bytes;
  int64_t block, slot, last_block;  // table index and slot of the current token
} BlockWalk;

// always_inline: gcc removes calls of a function whose only effect is a prefetch.
static inline __attribute__((always_inline)) void prefetch_block(const BlockWalk* w, int64_t block) {
  if (block > w->last_block) return;
  const int64_t first = w->table[block] * w->block_size;
  for (int64_t r = 0; r < w->block_size; r++) {
    const char* p = w->cache + ((first + r) * w->token_stride + w->head_offset) * w->elem_bytes;
    for (int64_t off = 0; off < w->row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
}

// `ahead`: a walk that only prefetches, ahead of its reader, so it prefetches its first block
// too (a reader loads its first block itself).
static inline BlockWalk walk_start(const void* cache, const int64_t* table, int64_t start,
                                   int64_t n, int64_t block_size, int64_t token_stride,
                                   int64_t head_offset, int64_t head_size, int kind, int ahead) {
  const int64_t elem = kv_elem_bytes(kind);
  BlockWalk w = {(const char*)cache, table, block_size, token_stride, head_offset,
                 head_size * elem, elem, start / block_size, start % block_size - 1,
                 (start + n - 1) / block_size};
  if (ahead) prefetch_block(&w, w.block);
  prefetch_block(&w, w.block + 1);
  return w;
}

// Element offset of the next token's row for this head.
static inline int64_t walk_next(BlockWalk* w) {
  if (++w->slot == w->block_size) {
    w->slot = 0;
    prefetch_block(w, ++w->block + 1);
  }
  return (w->table[w->block] * w->block_size + w->slot) * w->token_stride + w->head_offset;
}

#define VALUE_ACCS 24  // accumulator registers of one weighted-values pass

// One pass of weighted_values over heads g0 .. g0 + gn - 1 (gn <= HP) and the CP 16-float
// columns from c0 of their rows: HP * CP <= VALUE_ACCS sums in registers, each value row's
// columns loaded once per pass. HP and CP are constants after inlining.
static inline __attribute__((always_inline)) void values_pass(
    const void* v_cache, const int64_t* table, int64_t start, int64_t n, int64_t kh, int64_t g0,
    int gn, const int HP, int c0, const int CP, int64_t head_size, int64_t token_stride,
    int64_t block_size, const KV* kv, const float* p, int64_t ts, int64_t gs, const float* alpha,
    float* acc, BlockWalk* ahead) {
  __m512 r[VALUE_ACCS];
  for (int gi = 0; gi < HP; gi++) {
    if (gi >= gn) break;
    float* a = acc + (g0 + gi) * head_size + 16 * c0;
    const __m512 f = _mm512_set1_ps(alpha != NULL ? alpha[g0 + gi] : 0.f);
    for (int c = 0; c < CP; c++)  // earlier pieces' sums rescaled, else from zero
      r[gi * CP + c] = alpha != NULL ? _mm512_mul_ps(f, _mm512_loadu_ps(a + 16 * c))
                                     : _mm512_setzero_ps();
  }
  BlockWalk vw = walk_start(v_cache, table, start, n, block_size, token_stride, kh * head_size,
                            head_size, kv->kind, 0);
  const int64_t last = ahead != NULL ? ahead->last_block : -1;
  for (int64_t t = 0; t < n; t++) {
    const int64_t base = walk_next(&vw) + 16 * c0;
    if (ahead != NULL && ahead->block < last) walk_next(ahead);
    __m512 v[16];
    for (int c = 0; c < CP; c++) v[c] = load16_kv(v_cache, base + 16 * c, kv->kind, kv->v_scale);
    for (int gi = 0; gi < HP; gi++) {
      if (gi >= gn) break;
      const __m512 pv = _mm512_set1_ps(p[t * ts + (g0 + gi) * gs]);
      for (int c = 0; c < CP; c++) r[gi * CP + c] = _mm512_fmadd_ps(pv, v[c], r[gi * CP + c]);
    }
  }
  for (int gi = 0; gi < HP; gi++) {
    if (gi >= gn) break;
    float* a = acc + (g0 + gi) * head_size + 16 * c0;
    for (int c = 0; c < CP; c++) _mm512_storeu_ps(a + 16 * c, r[gi * CP + c]);
  }
}

// acc[g] = alpha[g] * acc[g] + sum over tokens of p[t * ts + g * gs] * v[t] for the pair's
// heads (alpha NULL: acc starts from zero), fp32 rows [group][head_size]. A pass keeps
// VALUE_ACCS sums in registers: as many heads as fit at full width, else every head (up to 24)
// over a part of the columns, so that each value row is read from cache once rather than once
// per few heads. `ahead` (NULL: none), a prefetch-only walk over the next piece's key rows,
// advances one token per token of the first pass, so that memory streams while the values are
// weighed.
static inline __attribute__((always_inline)) void weighted_values(
    const void* v_cache, const int64_t* table, int64_t start, int64_t n, int64_t kh, int64_t group,
    const int DV, int64_t token_stride, int64_t block_size, const KV* kv, const float* p,
    int64_t ts, int64_t gs, const float* alpha, float* acc, BlockWalk* ahead) {
  const int64_t head_size = 16 * DV;
#define VALUES(CP)                                                                           \
  for (int64_t g0 = 0; g0 < group; g0 += VALUE_ACCS / (CP))                                   \
    for (int c0 = 0; c0 < DV; c0 += (CP))                                                    \
      values_pass(v_cache, table, start, n, kh, g0,                                          \
                  (int)(group - g0 < VALUE_ACCS / (CP) ? group - g0 : VALUE_ACCS / (CP)),      \
                  VALUE_ACCS / (CP), c0, (CP), head_size, token_stride, block_size, kv, p, ts, \
                  gs, alpha, acc, g0 == 0 && c0 == 0 ? ahead : NULL)
  const int cp = DV > 16 ? 16 : DV;  // a pass's columns: at most 16 value registers
  if (group * cp <= VALUE_ACCS) {
    VALUES(cp);
  } else if (group * (cp / 2) <= VALUE_ACCS) {
    VALUES(cp / 2);
  } else if (group * (cp / 4) <= VALUE_ACCS) {
    VALUES(cp / 4);
  } else {
    VALUES(1);
  }
#undef VALUES
}

// Scores in base 2, head-major: scores[g * stride + t] = log2(e) * scale * q_g . k_t for the
// pair's heads, -inf for the padding t = n .. stride - 1 (stride: n rounded up to 16).
// Sixteen tokens at a time: each run of 16 elements (fp32 path) or element pairs (BF16) of
// their key rows is transposed in registers (lane = token), then every head adds 16 FMAs
// (vdpbf16ps) with its query's elements broadcast; the heads' chains are independent, so the
// loop over them overlaps. BF16: raw bf16 queries against a bf16 cache, exact products and
// fp32 sums, scaled after the sum; fp32: keys of any cache kind converted, queries prescaled
// into qf.
static inline __attribute__((always_inline)) void scores_t(
    const void* q, int64_t q_offset, const void* k_cache, const void* v_cache, BlockWalk* kw,
    int64_t n, int64_t group, const int DV, const int BF16, float scale, int bf16, const KV* kv,
    float* qf, float* scores, int64_t stride) {
  const int64_t head_size = 16 * DV;
  const int RUNS = BF16 ? DV / 2 : DV;                  // runs of 16 elements (pairs) per row
  const int64_t qn = BF16 ? head_size / 2 : head_size;  // elements (pairs) per query row
  const float s2 = scale * 1.4426950408889634f;
  const uint32_t* qp = (const uint32_t*)((const uint16_t*)q + q_offset);
  if (!BF16)
    for (int64_t g = 0; g < group; g++)
      for (int c = 0; c < DV; c++)
        _mm512_storeu_ps(qf + g * head_size + 16 * c,
                         _mm512_mul_ps(load16(q, q_offset + g * head_size + 16 * c, bf16),
                                       _mm512_set1_ps(s2)));
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = n - t0 < 16 ? (int)(n - t0) : 16;
    int64_t base[16];
    for (int i = 0; i < m; i++) {
      base[i] = walk_next(kw);
      // the same tokens' value rows into L2 for the weighted values: streamed now, while the
      // scores leave memory idle, rather than waited for then
      const char* vr = (const char*)v_cache + base[i] * kw->elem_bytes;
      for (int64_t off = 0; off < kw->row_bytes; off += 64) _mm_prefetch(vr + off, _MM_HINT_T1);
    }
    for (int run = 0; run < RUNS; run++) {
      __m512 r[16];  // fp32 elements, or bf16 pairs as 32-bit lanes
      for (int i = 0; i < 16; i++) {
        if (i >= m)
          r[i] = _mm512_setzero_ps();
        else if (BF16)
          r[i] = _mm512_loadu_ps((const uint16_t*)k_cache + base[i] + 32 * run);
        else
          r[i] = load16_kv(k_cache, base[i] + 16 * run, kv->kind, kv->k_scale);
      }
      transpose16(r);
      for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * stride + t0;
        __m512 a0 = run ? _mm512_loadu_ps(sg) : _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int j = 0; j < 16; j += 2) {  // two chains of 8
          const int64_t c = g * qn + 16 * run + j;
#ifdef __AVX512BF16__
          if (BF16) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32((int)qp[c]), (__m512bh)r[j]);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32((int)qp[c + 1]),
                                  (__m512bh)r[j + 1]);
            continue;
          }
#endif
          a0 = _mm512_fmadd_ps(_mm512_set1_ps(qf[c]), r[j], a0);
          a1 = _mm512_fmadd_ps(_mm512_set1_ps(qf[c + 1]), r[j + 1], a1);
        }
        __m512 s = _mm512_add_ps(a0, a1);
        if (run == RUNS - 1) {
          if (BF16) s = _mm512_mul_ps(s, _mm512_set1_ps(s2));
          s = _mm512_mask_blend_ps((__mmask16)((1u << m) - 1), _mm512_set1_ps(-INFINITY), s);
        }
        _mm512_storeu_ps(sg, s);
      }
    }
  }
}

#define DECODE_PIECE 256  // tokens per piece: one piece's scores and values while the next's
                          // keys stream into L2

// The pair (sequence, kv head) with head_size = 16 * DV; DV is a constant after inlining.
// Pieces of DECODE_PIECE tokens in turn, flash-style: scores (head-major, scores_t, so the
// softmax runs along each head's tokens in whole vectors), the running max and sum updated, the
// accumulators rescaled and the piece's weighted values added; each piece's values stream in
// while its scores run, the next piece's keys while its values are weighed.
static inline __attribute__((always_inline)) void attend_avx512(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* table, int64_t start,
    int64_t end, void* out, int64_t b, int64_t kh, int64_t num_heads, int64_t group, const int DV,
    int64_t token_stride, int64_t block_size, float scale, int bf16, const KV* kv, float* part,
    float* lse, float* qf, float* scores, float* acc) {
  const int64_t head_size = 16 * DV;
  const int64_t n = end - start;
  BlockWalk kw = walk_start(k_cache, table, start, n, block_size, token_stride, kh * head_size,
                            head_size, kv->kind, 0);
  const int64_t q_offset = (b * num_heads + kh * group) * head_size;
  float m[group], l[group], alpha[group];  // running max (base 2), sum, this piece's rescale
  for (int64_t p0 = 0; p0 < n; p0 += DECODE_PIECE) {
    const int64_t pn = n - p0 < DECODE_PIECE ? n - p0 : DECODE_PIECE;
    const int64_t stride = (pn + 15) & ~(int64_t)15;
#ifdef __AVX512BF16__
    if (bf16 && kv->kind == KV_BF16)
      scores_t(q, q_offset, k_cache, v_cache, &kw, pn, group, DV, 1, scale, bf16, kv, qf, scores,
               stride);
    else
#endif
      scores_t(q, q_offset, k_cache, v_cache, &kw, pn, group, DV, 0, scale, bf16, kv, qf, scores,
               stride);
    for (int64_t g = 0; g < group; g++) {
      float* sg = scores + g * stride;
      __m512 mv = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < stride; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
      const float piece_max = _mm512_reduce_max_ps(mv);
      const float m_new = p0 == 0 || piece_max > m[g] ? piece_max : m[g];
      const __m512 mx = _mm512_set1_ps(m_new);
      __m512 sv = _mm512_setzero_ps();
      for (int64_t t = 0; t < stride; t += 16) {
        const __m512 e = exp2_512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mx));
        _mm512_storeu_ps(sg + t, e);
        sv = _mm512_add_ps(sv, e);
      }
      alpha[g] = p0 == 0 ? 0.f : exp2f(m[g] - m_new);
      l[g] = (p0 == 0 ? 0.f : l[g] * alpha[g]) + _mm512_reduce_add_ps(sv);
      m[g] = m_new;
    }
    const int64_t next = p0 + pn, n_next = n - next < DECODE_PIECE ? n - next : DECODE_PIECE;
    BlockWalk ahead, *next_keys = NULL;  // the next piece's keys, into L2 during the values
    if (n_next > 0) {
      ahead = walk_start(k_cache, table, start + next, n_next, block_size, token_stride,
                         kh * head_size, head_size, kv->kind, 1);
      next_keys = &ahead;
    }
    weighted_values(v_cache, table, start + p0, pn, kh, group, DV, token_stride, block_size, kv,
                    scores, 1, stride, p0 == 0 ? NULL : alpha, acc, next_keys);
  }
  for (int64_t g = 0; g < group; g++) {
    float* row = acc + g * head_size;
    const __m512 inv = _mm512_set1_ps(1.f / l[g]);
    for (int c = 0; c < DV; c++)
      _mm512_storeu_ps(row + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), inv));
    store_head(out, part, b, kh * group + g, g, num_heads, head_size, bf16, row);
    if (lse != NULL) lse[g] = (m[g] + log2f(l[g])) * 0.6931471805599453f;
  }
}
#endif

#ifdef PAGEDLM_AMX
// Tiles: 0 = scores [16 tokens x 16 heads] fp32, 1 = keys [16 tokens x 32 dims] bf16,
// 2 = queries [16 dim pairs x 16 heads x 2] bf16 (the VNNI layout AMX wants for B); for the
// weighted values 0-3 = sums [16 heads x 16 dims] fp32, 4 = probabilities [16 heads x 32
// tokens] bf16, 5 = values [16 token pairs x 16 dims x 2] bf16.
static void amx_configure(void) { amx_configure_full_tiles(6); }

#define VALUE_CHUNKS 8  // chunks of 32 tokens whose value tiles are laid out at once

// Per-thread scratch of attend_amx for a context of up to `tokens` keys: the token slots, the
// probabilities as A tiles, VALUE_CHUNKS chunks' value B tiles.
static inline int64_t amx_values_scratch_bytes(int64_t tokens) {
  const int64_t chunks = (tokens + 31) / 32;
  return chunks * 32 * 8 + chunks * 1024 + VALUE_CHUNKS * 4 * 1024;
}

// acc[h][0 .. head_size) = sum over the n tokens of p[t * 16 + h] * v[t] for the heads h <
// kv_count * group (h / group: its kv head, kh on), on AMX: the probabilities rounded to bf16
// (as flash attention weighs values), exact products, fp32 sums. Per 32 tokens they are one A
// tile (P transposed); each kv head's value rows, interleaved by token pairs, are the B tiles
// of 16 dimensions. Rows of heads of another kv head are computed and dropped.
static inline __attribute__((always_inline)) void weighted_values_amx(
    const void* v_cache, const int64_t* table, int64_t start, int64_t n, int64_t kh,
    int64_t kv_count, int64_t group, const int DV, int64_t token_stride, int64_t block_size,
    const float* p, char* scratch, float* acc) {
  const int64_t head_size = 16 * DV, chunks = (n + 31) / 32;
  int64_t* slots = (int64_t*)scratch;
  uint16_t* pa = (uint16_t*)(scratch + chunks * 32 * 8);  // [chunk][16 heads][32 tokens]
  uint16_t* vb = pa + chunks * 512;  // [VALUE_CHUNKS][4 tiles][16 pairs][16 dims][2]
  for (int64_t t = 0; t < 32 * chunks; t++) {
    const int64_t pos = start + t;  // past n: never read
    slots[t] = t < n ? table[pos / block_size] * block_size + pos % block_size : -1;
  }
  for (int64_t c = 0; c < chunks; c++) {
    __m512 lo[16], hi[16];
    for (int i = 0; i < 16; i++) {
      const int64_t t = 32 * c + i;
      lo[i] = t < n ? _mm512_loadu_ps(p + t * 16) : _mm512_setzero_ps();
      hi[i] = t + 16 < n ? _mm512_loadu_ps(p + (t + 16) * 16) : _mm512_setzero_ps();
    }
    transpose16(lo);
    transpose16(hi);
    for (int h = 0; h < 16; h++)
      _mm512_storeu_si512(pa + c * 512 + h * 32, (__m512i)_mm512_cvtne2ps_pbh(hi[h], lo[h]));
  }
  uint16_t idx[32];  // (a[k], b[k]) for k < 16: a's k, then b's (32 + k)
  for (int k = 0; k < 16; k++) {
    idx[2 * k] = (uint16_t)k;
    idx[2 * k + 1] = (uint16_t)(32 + k);
  }
  const __m512i pairs = _mm512_loadu_si512(idx);
  const uint16_t* vc = (const uint16_t*)v_cache;
  float sums[4][256] __attribute__((aligned(64)));
  for (int64_t j = 0; j < kv_count; j++)
    for (int64_t d0 = 0; d0 < head_size; d0 += 64) {  // four 16-dimension tiles at a time
      const int tiles = head_size - d0 < 64 ? (int)((head_size - d0) / 16) : 4;
      _tile_zero(0);  // tile numbers are immediates
      if (tiles > 1) _tile_zero(1);
      if (tiles > 2) _tile_zero(2);
      if (tiles > 3) _tile_zero(3);
      // a group of chunks' value tiles is written, then multiplied: tile loads of bytes just
      // stored wait for the stores to retire, and this way they wait once per group
      for (int64_t c0 = 0; c0 < chunks; c0 += VALUE_CHUNKS) {
        const int64_t cn = chunks - c0 < VALUE_CHUNKS ? chunks - c0 : VALUE_CHUNKS;
        for (int64_t c = 0; c < cn; c++)
          for (int i = 0; i < 16; i++) {
            const int64_t sa = slots[32 * (c0 + c) + 2 * i], sb = slots[32 * (c0 + c) + 2 * i + 1];
            const uint16_t* ra = vc + sa * token_stride + (kh + j) * head_size + d0;
            const uint16_t* rb = vc + sb * token_stride + (kh + j) * head_size + d0;
            for (int q = 0; q < tiles; q++) {
              const __m512i a = sa < 0 ? _mm512_setzero_si512()
                                       : _mm512_castsi256_si512(_mm256_loadu_si256(
                                             (const __m256i*)(ra + 16 * q)));
              const __m512i b = sb < 0 ? _mm512_setzero_si512()
                                       : _mm512_castsi256_si512(_mm256_loadu_si256(
                                             (const __m256i*)(rb + 16 * q)));
              _mm512_store_si512(vb + (c * 4 + q) * 512 + i * 32,
                                 _mm512_permutex2var_epi16(a, pairs, b));
            }
          }
        for (int64_t c = 0; c < cn; c++) {
          _tile_loadd(4, pa + (c0 + c) * 512, 64);
          for (int q = 0; q < tiles; q++) {
            _tile_loadd(5, vb + (c * 4 + q) * 512, 64);
            switch (q) {
              case 0: _tile_dpbf16ps(0, 4, 5); break;
              case 1: _tile_dpbf16ps(1, 4, 5); break;
              case 2: _tile_dpbf16ps(2, 4, 5); break;
              default: _tile_dpbf16ps(3, 4, 5);
            }
          }
        }
      }
      _tile_stored(0, sums[0], 64);
      if (tiles > 1) _tile_stored(1, sums[1], 64);
      if (tiles > 2) _tile_stored(2, sums[2], 64);
      if (tiles > 3) _tile_stored(3, sums[3], 64);
      for (int64_t g = 0; g < group; g++) {
        const int64_t h = j * group + g;
        for (int q = 0; q < tiles; q++)
          _mm512_storeu_ps(acc + h * head_size + d0 + 16 * q, _mm512_load_ps(sums[q] + h * 16));
      }
    }
}

#define AMX_KEYS_AHEAD 4  // runs of 16 keys prefetched ahead of the tile loads (-10% a step)

// bf16 caches, kv_count * group <= 16, head_size = 16 * DV with DV even, block_size % 16 ==
// 0: kv heads kh .. kh + kv_count - 1 and their query heads (kv_count > 1: every head of the
// sequence, a whole token row per token). The scores come from AMX, 16 tokens (one aligned run
// of cache slots, read in place) by all the heads at once, with exact bf16 products and fp32
// sums: each kv head's keys against its heads' queries (zero columns elsewhere) into one
// tile. The softmax in AVX-512, the weighted values on AMX (weighted_values_amx).
static inline __attribute__((always_inline)) void attend_amx(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* table, int64_t start,
    int64_t len, void* out, int64_t b, int64_t kh, int64_t kv_count, int64_t num_heads,
    int64_t group, const int DV, int64_t token_stride, int64_t block_size, float scale,
    float* part, float* lse, uint16_t* qb, float* scores, char* scratch, float* acc) {
  const int64_t head_size = 16 * DV, heads = kv_count * group;
  const int64_t first = start & ~(int64_t)15;  // scores[i] is position first + i
  const uint16_t* qh = (const uint16_t*)q + (b * num_heads + kh * group) * head_size;
  // qb[j][c][pair r][head column h][2] = dims 32 c + 2 r, + 1 of head h, zero for the heads of
  // other kv heads than j: per (j, c) a 16 x 16 transpose of 32-bit dim pairs (one scalar loop
  // over its 4096 values was 17% of a decode step's attention at 32 x 320 keys)
  for (int64_t j = 0; j < kv_count; j++)
    for (int64_t c = 0; c < DV / 2; c++) {
      __m512 pairs[16];
      for (int64_t h = 0; h < 16; h++)
        pairs[h] = h / group == j && h < heads
                       ? _mm512_loadu_ps((const float*)(qh + h * head_size + 32 * c))
                       : _mm512_setzero_ps();
      transpose16(pairs);
      for (int64_t r = 0; r < 16; r++)
        _mm512_storeu_ps((float*)(qb + (j * DV / 2 + c) * 512 + r * 32), pairs[r]);
    }
  const int64_t row_bytes = kv_count * head_size * 2;
  for (int64_t pos = first; pos < len; pos += 16) {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    const uint16_t* keys = (const uint16_t*)k_cache + slot * token_stride + kh * head_size;
    // tile loads wait on memory: the keys AMX_KEYS_AHEAD runs on into L2, and these tokens'
    // values into L2 for the weighted values
    const int64_t ahead = pos + 16 * AMX_KEYS_AHEAD;
    const char* next = NULL;
    if (ahead < len) {
      const int64_t next_slot = table[ahead / block_size] * block_size + ahead % block_size;
      next = (const char*)((const uint16_t*)k_cache + next_slot * token_stride + kh * head_size);
    }
    const char* vals =
        (const char*)((const uint16_t*)v_cache + slot * token_stride + kh * head_size);
    for (int64_t r = 0; r < 16; r++)
      for (int64_t off = 0; off < row_bytes; off += 64) {
        if (next != NULL) _mm_prefetch(next + r * token_stride * 2 + off, _MM_HINT_T1);
        _mm_prefetch(vals + r * token_stride * 2 + off, _MM_HINT_T1);
      }
    _tile_zero(0);
    for (int64_t j = 0; j < kv_count; j++)
      for (int64_t c = 0; c < DV / 2; c++) {
        _tile_loadd(1, keys + j * head_size + 32 * c, token_stride * 2);
        _tile_loadd(2, qb + (j * DV / 2 + c) * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
    _tile_stored(0, scores + (pos - first) * 16, 64);
  }
  // Softmax over positions start .. len - 1, all heads in one vector.
  float* valid = scores + (start - first) * 16;
  const int64_t n = len - start;
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(valid + t * 16));
  for (int64_t t = 0; t < n; t++) {
    const __m512 s = _mm512_sub_ps(_mm512_loadu_ps(valid + t * 16), mx);
    const __m512 e = exp512(_mm512_mul_ps(s, vscale));
    _mm512_storeu_ps(valid + t * 16, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), sum);
  for (int64_t t = 0; t < n; t++)
    _mm512_storeu_ps(valid + t * 16, _mm512_mul_ps(_mm512_loadu_ps(valid + t * 16), inv));
  if (lse != NULL) {
    float mxs[16], sums[16];
    _mm512_storeu_ps(mxs, mx);
    _mm512_storeu_ps(sums, sum);
    for (int64_t h = 0; h < heads; h++) lse[h] = mxs[h] * scale + logf(sums[h]);
  }
  weighted_values_amx(v_cache, table, start, n, kh, kv_count, group, DV, token_stride,
                      block_size, valid, scratch, acc);
  for (int64_t h = 0; h < heads; h++)
    store_head(out, part, b, kh * group + h, h, num_heads, head_size, 1, acc + h * head_size);
}
#endif
