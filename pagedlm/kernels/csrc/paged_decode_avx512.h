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
// prefetcher stops at each block's end: entering a block prefetches all rows of the next one.
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
    for (int64_t off = 0; off < w->row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  }
}

static inline BlockWalk walk_start(const void* cache, const int64_t* table, int64_t start,
                                   int64_t n, int64_t block_size, int64_t token_stride,
                                   int64_t head_offset, int64_t head_size, int kind) {
  const int64_t elem = kv_elem_bytes(kind);
  BlockWalk w = {(const char*)cache, table, block_size, token_stride, head_offset,
                 head_size * elem, elem, start / block_size, start % block_size - 1,
                 (start + n - 1) / block_size};
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

// out[g] = sum over tokens of p[t][g] * v[t] for the pair's heads; p rows are `stride` apart.
// Heads go in passes of 16 / DV so that the accumulators fit in 16 registers.
static inline __attribute__((always_inline)) void weighted_values(
    const void* v_cache, const int64_t* table, int64_t start, int64_t n, void* out, int64_t b,
    int64_t kh, int64_t num_heads, int64_t group, const int DV, int64_t token_stride,
    int64_t block_size, int bf16, const KV* kv, float* part, const float* p, int64_t stride,
    float* row) {
  const int64_t head_size = 16 * DV;
  const int64_t per_pass = DV >= 16 ? 1 : 16 / DV;
  for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
    const int64_t gn = group - g0 < per_pass ? group - g0 : per_pass;
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    BlockWalk vw = walk_start(v_cache, table, start, n, block_size, token_stride, kh * head_size,
                              head_size, kv->kind);
    for (int64_t t = 0; t < n; t++) {
      const int64_t base = walk_next(&vw);
      __m512 v[16];
      for (int c = 0; c < DV; c++) v[c] = load16_kv(v_cache, base + 16 * c, kv->kind, kv->v_scale);
      for (int64_t gi = 0; gi < gn; gi++) {
        const __m512 pv = _mm512_set1_ps(p[t * stride + g0 + gi]);
        for (int c = 0; c < DV; c++) acc[gi * DV + c] = _mm512_fmadd_ps(pv, v[c], acc[gi * DV + c]);
      }
    }
    for (int64_t gi = 0; gi < gn; gi++) {
      for (int c = 0; c < DV; c++) _mm512_storeu_ps(row + 16 * c, acc[gi * DV + c]);
      store_head(out, part, b, kh * group + g0 + gi, g0 + gi, num_heads, head_size, bf16, row);
    }
  }
}

// Lane i of the result = the sum of the 16 lanes of a[i], for i < 8 (a transposing reduction:
// 24 shuffles and adds instead of 8 separate horizontal sums).
static inline __m256 hsum8(const __m512 a[8]) {
  __m512 b[4], c[2];
  for (int i = 0; i < 4; i++) {
    const __m512 x = a[2 * i], y = a[2 * i + 1];
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; i++) {  // quarter j of c[i] holds 4 partial sums of a[4i + j]
    const __m512 x = b[2 * i], y = b[2 * i + 1];
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m512 d = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 e = _mm512_add_ps(d, _mm512_permute_ps(d, _MM_SHUFFLE(1, 0, 3, 2)));
  // lane 4j of e is the sum of a[j], lane 4j + 1 the sum of a[4 + j]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, e));
}

// scores[t][g] = (q_g * scale) . k_t in fp32 for the pair's heads (queries from q_offset on),
// token-major with rows G8 apart.
static inline __attribute__((always_inline)) void scores_f32(const void* q, int64_t q_offset,
                                                             const void* k_cache, BlockWalk* kw,
                                                             int64_t n, int64_t group,
                                                             const int DV, float scale, int bf16,
                                                             const KV* kv, float* qf,
                                                             float* scores, int64_t G8) {
  const int64_t head_size = 16 * DV;
  for (int64_t g = 0; g < group; g++)
    for (int c = 0; c < DV; c++) {
      const __m512 qv = load16(q, q_offset + g * head_size + 16 * c, bf16);
      _mm512_storeu_ps(qf + g * head_size + 16 * c, _mm512_mul_ps(qv, _mm512_set1_ps(scale)));
    }
  for (int64_t t = 0; t < n; t++) {
    const int64_t base = walk_next(kw);
    __m512 k[16];
    for (int c = 0; c < DV; c++) k[c] = load16_kv(k_cache, base + 16 * c, kv->kind, kv->k_scale);
    for (int64_t g0 = 0; g0 < group; g0 += 8) {
      __m512 a[8];
      for (int64_t i = 0; i < 8; i++) {
        a[i] = _mm512_setzero_ps();
        if (g0 + i >= group) continue;
        const float* qg = qf + (g0 + i) * head_size;
        for (int c = 0; c < DV; c++)
          a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], a[i]);
      }
      _mm256_storeu_ps(scores + t * G8 + g0, hsum8(a));
    }
  }
}

#ifdef __AVX512BF16__
// Scores of bf16 queries (qh: the pair's first head) against a bf16 cache: vdpbf16ps on the
// raw pairs (exact products, fp32 sums), scaled after the sum; [n][G8] as the fp32 path.
static inline __attribute__((always_inline)) void scores_bf16(const uint16_t* qh,
                                                              const void* k_cache, BlockWalk* kw,
                                                              int64_t n, int64_t group,
                                                              const int DV, float scale,
                                                              float* scores, int64_t G8) {
  const int64_t head_size = 16 * DV;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t = 0; t < n; t++) {
    const uint16_t* row = (const uint16_t*)k_cache + walk_next(kw);
    __m512bh k[8];
    for (int c = 0; c < DV / 2; c++) k[c] = (__m512bh)_mm512_loadu_si512(row + 32 * c);
    for (int64_t g0 = 0; g0 < group; g0 += 8) {
      __m512 a[8];
      for (int64_t i = 0; i < 8; i++) {
        a[i] = _mm512_setzero_ps();
        if (g0 + i >= group) continue;
        const uint16_t* qg = qh + (g0 + i) * head_size;
        for (int c = 0; c < DV / 2; c++)
          a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(qg + 32 * c), k[c]);
      }
      _mm256_storeu_ps(scores + t * G8 + g0, _mm256_mul_ps(hsum8(a), vscale));
    }
  }
}
#endif

// The pair (sequence, kv head) with head_size = 16 * DV; DV is a constant after inlining, so
// the key/value row and the accumulators live in registers. Scores are kept token-major,
// [n][G8] with G8 = group rounded up to 8, so the softmax runs across heads in one vector.
static inline __attribute__((always_inline)) void attend_avx512(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* table, int64_t start,
    int64_t end, void* out, int64_t b, int64_t kh, int64_t num_heads, int64_t group, const int DV,
    int64_t token_stride, int64_t block_size, float scale, int bf16, const KV* kv, float* part,
    float* lse, float* qf, float* scores, float* row) {
  const int64_t head_size = 16 * DV;
  const int64_t G8 = (group + 7) & ~(int64_t)7;
  const int64_t n = end - start;
  const int64_t head_offset = kh * head_size;
  BlockWalk kw = walk_start(k_cache, table, start, n, block_size, token_stride, head_offset,
                            head_size, kv->kind);
  const int64_t q_offset = (b * num_heads + kh * group) * head_size;
#ifdef __AVX512BF16__
  if (bf16 && kv->kind == KV_BF16)
    scores_bf16((const uint16_t*)q + q_offset, k_cache, &kw, n, group, DV, scale, scores, G8);
  else
#endif
    scores_f32(q, q_offset, k_cache, &kw, n, group, DV, scale, bf16, kv, qf, scores, G8);
  for (int64_t g0 = 0; g0 < G8; g0 += 8) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t++)
      mx = _mm512_max_ps(mx, _mm512_zextps256_ps512(_mm256_loadu_ps(scores + t * G8 + g0)));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
      float* st = scores + t * G8 + g0;
      const __m512 e = exp512(_mm512_sub_ps(_mm512_zextps256_ps512(_mm256_loadu_ps(st)), mx));
      _mm256_storeu_ps(st, _mm512_castps512_ps256(e));
      sum = _mm512_add_ps(sum, e);
    }
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), _mm512_castps512_ps256(sum));
    for (int64_t t = 0; t < n; t++) {
      float* st = scores + t * G8 + g0;
      _mm256_storeu_ps(st, _mm256_mul_ps(_mm256_loadu_ps(st), inv));
    }
    if (lse != NULL) {
      float mxs[16], sums[16];
      _mm512_storeu_ps(mxs, mx);
      _mm512_storeu_ps(sums, sum);
      for (int64_t i = 0; i < 8 && g0 + i < group; i++) lse[g0 + i] = mxs[i] + logf(sums[i]);
    }
  }
  weighted_values(v_cache, table, start, n, out, b, kh, num_heads, group, DV, token_stride,
                  block_size, bf16, kv, part, scores, G8, row);
}
#endif

#ifdef PAGEDLM_AMX
// Tiles: 0 = scores [16 tokens x 16 heads] fp32, 1 = keys [16 tokens x 32 dims] bf16,
// 2 = queries [16 dim pairs x 16 heads x 2] bf16 (the VNNI layout AMX wants for B).
static void amx_configure(void) { amx_configure_full_tiles(3); }

// bf16 caches, group <= 16, head_size = 16 * DV with DV even, block_size % 16 == 0: the scores
// come from AMX, 16 tokens (one aligned run of cache slots, read in place) by all heads at
// once, with exact bf16 products and fp32 sums; the softmax and the values as in AVX-512.
static inline __attribute__((always_inline)) void attend_amx(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* table, int64_t start,
    int64_t len, void* out, int64_t b, int64_t kh, int64_t num_heads, int64_t group, const int DV,
    int64_t token_stride, int64_t block_size, float scale, const KV* kv, float* part, float* lse,
    uint16_t* qb, float* scores, float* row) {
  const int64_t head_size = 16 * DV;
  const int64_t first = start & ~(int64_t)15;  // scores[i] is position first + i
  const uint16_t* qh = (const uint16_t*)q + (b * num_heads + kh * group) * head_size;
  for (int64_t c = 0; c < DV / 2; c++)  // qb[c][pair r][head g][2]
    for (int64_t r = 0; r < 16; r++)
      for (int64_t g = 0; g < 16; g++)
        for (int64_t e = 0; e < 2; e++)
          qb[((c * 16 + r) * 16 + g) * 2 + e] =
              g < group ? qh[g * head_size + 32 * c + 2 * r + e] : 0;
  for (int64_t pos = first; pos < len; pos += 16) {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    const uint16_t* keys = (const uint16_t*)k_cache + slot * token_stride + kh * head_size;
    _tile_zero(0);
    for (int64_t c = 0; c < DV / 2; c++) {
      _tile_loadd(1, keys + 32 * c, token_stride * 2);
      _tile_loadd(2, qb + c * 512, 64);
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
    for (int64_t g = 0; g < group; g++) lse[g] = mxs[g] * scale + logf(sums[g]);
  }
  weighted_values(v_cache, table, start, n, out, b, kh, num_heads, group, DV, token_stride,
                  block_size, 1, kv, part, valid, 16, row);
}
#endif
