// Paged attention for decode rows (one query token per sequence); bf16 or fp32 queries, caches
// of the query dtype or fp8 (e4m3 / e5m2 with a per-tensor scale, converted in registers).
//
// KV cache layout: [num_blocks, block_size, num_kv_heads, head_size] per K and V.
// Work items are (sequence, kv head, split): a long sequence's context is cut into splits that
// different threads attend (split-KV), each leaving its normalized partial output and its
// log-sum-exp; a second pass merges the splits of each head. The number of splits per sequence
// comes from the sequence lengths and the thread count (decode_splits), so that one long
// sequence keeps every core busy while a big batch of short ones is not split at all. Each
// item reads its keys and values once through the block table (no copy of the cache), scores
// them against its group of query heads and takes a softmax, all in fp32. Scratch buffers are
// per thread. Head sizes 64, 128 and 256 take an AVX-512 path where the compiler targets it;
// every size has the portable one.
#include <stdlib.h>

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

// One (sequence, kv head) pair, portable C that gcc vectorizes; inlined with constant head
// sizes so the loops unroll.
static inline __attribute__((always_inline)) void attend(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* table, int64_t start,
    int64_t end, void* out, int64_t b, int64_t kh, int64_t num_heads, int64_t group,
    const int64_t head_size, int64_t token_stride, int64_t block_size, float scale, int bf16,
    const KV* kv, float* part, float* lse, float* qf, float* acc, float* scores, float* row) {
  const int64_t n = end - start;
  const int64_t head_offset = kh * head_size;
  for (int64_t g = 0; g < group; g++) {
    float* qg = qf + g * head_size;
    load_row(q, (b * num_heads + kh * group + g) * head_size, head_size, bf16, qg);
#pragma omp simd
    for (int64_t d = 0; d < head_size; d++) qg[d] *= scale;
  }
  for (int64_t t = 0; t < n; t++) {
    const int64_t pos = start + t;
    const int64_t base = (table[pos / block_size] * block_size + pos % block_size) * token_stride;
    load_kv_row(k_cache, base + head_offset, head_size, kv->kind, kv->k_scale, row);
    for (int64_t g = 0; g < group; g++) {
      const float* restrict qg = qf + g * head_size;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_size; d++) s += qg[d] * row[d];
      scores[g * n + t] = s;
    }
  }
  for (int64_t g = 0; g < group; g++) {
    float* restrict sg = scores + g * n;
    float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
      sg[t] = exp_clamped(sg[t] - mx);
      sum += sg[t];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) sg[t] *= inv;
    if (lse != NULL) lse[g] = mx + logf(sum);
  }
  memset(acc, 0, sizeof(float) * group * head_size);
  for (int64_t t = 0; t < n; t++) {
    const int64_t pos = start + t;
    const int64_t base = (table[pos / block_size] * block_size + pos % block_size) * token_stride;
    load_kv_row(v_cache, base + head_offset, head_size, kv->kind, kv->v_scale, row);
    for (int64_t g = 0; g < group; g++) {
      const float p = scores[g * n + t];
      float* restrict ag = acc + g * head_size;
#pragma omp simd
      for (int64_t d = 0; d < head_size; d++) ag[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; g++)
    store_head(out, part, b, kh * group + g, g, num_heads, head_size, bf16, acc + g * head_size);
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

static inline void prefetch_block(const BlockWalk* w, int64_t block) {
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
  for (int64_t g = 0; g < group; g++) {
    const int64_t q_offset = (b * num_heads + kh * group + g) * head_size;
    for (int c = 0; c < DV; c++) {
      const __m512 qv = load16(q, q_offset + 16 * c, bf16);
      _mm512_storeu_ps(qf + g * head_size + 16 * c, _mm512_mul_ps(qv, _mm512_set1_ps(scale)));
    }
  }
  BlockWalk kw = walk_start(k_cache, table, start, n, block_size, token_stride, head_offset,
                            head_size, kv->kind);
  for (int64_t t = 0; t < n; t++) {
    const int64_t base = walk_next(&kw);
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

#define MAX_SPLITS 64

// Keys each sequence attends (its window's worth at most).
static inline int64_t attended(int64_t len, int64_t window) {
  return window > 0 && len > window ? window : len;
}

// Splits per sequence: about 4 items per thread in all, none shorter than min_split keys (so a
// batch of many sequences is not split, one long sequence is cut into pieces for every core).
void paged_decode_num_splits(const int64_t* seq_lens, int64_t num_seqs, int64_t num_kv_heads,
                             int64_t window, int64_t min_split, int num_threads, int64_t* splits) {
  int64_t total = 0;
  for (int64_t b = 0; b < num_seqs; b++) total += attended(seq_lens[b], window) * num_kv_heads;
  const int64_t target = 4 * (int64_t)num_threads;
  int64_t piece = (total + target - 1) / target;
  piece = piece > min_split ? piece : min_split;
  piece = piece > 1 ? piece : 1;
  for (int64_t b = 0; b < num_seqs; b++) {
    int64_t n = (attended(seq_lens[b], window) + piece - 1) / piece;
    splits[b] = n < 1 ? 1 : n > MAX_SPLITS ? MAX_SPLITS : n;
  }
}

// Split sp of sp_count over the keys sequence `len` attends: positions [*lo, *hi), never empty
// when the caller's split counts come from paged_decode_num_splits.
static inline void split_range(int64_t len, int64_t window, int64_t sp, int64_t sp_count,
                               int64_t* lo, int64_t* hi) {
  const int64_t start = len - attended(len, window), n = len - start;
  const int64_t piece = (n + sp_count - 1) / sp_count;
  *lo = start + sp * piece;
  *hi = *lo + piece < len ? *lo + piece : len;
}

// Returns 0, or -1 when scratch memory ran out. kind / k_scale / v_scale describe the cache
// (KV_* in common.h); q and out are bf16 when `bf16`, else fp32. min_split: fewest keys per
// split (0: 256).
int paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                           const int64_t* block_table, int64_t max_blocks,
                           const int64_t* seq_lens, void* out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                           int64_t block_size, float scale, int64_t window, int bf16, int kind,
                           float k_scale, float v_scale, int64_t min_split, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_size;
  const KV kv = {kind, k_scale, v_scale};
  int64_t* splits = malloc(sizeof(int64_t) * (3 * num_seqs + 1));
  if (splits == NULL) return -1;
  int64_t* first_item = splits + num_seqs;  // [num_seqs + 1]
  int64_t* first_part = first_item + num_seqs + 1;  // partial-row index, split sequences only
  paged_decode_num_splits(seq_lens, num_seqs, num_kv_heads, window, min_split > 0 ? min_split : 256,
                          num_threads, splits);
  int64_t max_piece = 1, num_parts = 0;
  first_item[0] = 0;
  for (int64_t b = 0; b < num_seqs; b++) {
    const int64_t piece = (attended(seq_lens[b], window) + splits[b] - 1) / splits[b];
    max_piece = piece > max_piece ? piece : max_piece;
    first_item[b + 1] = first_item[b] + splits[b] * num_kv_heads;
    first_part[b] = num_parts;
    if (splits[b] > 1) num_parts += splits[b] * num_kv_heads;
  }
  const int64_t num_items = first_item[num_seqs];
  // per split item: [group][head_size] normalized fp32 rows, then [group] log-sum-exps
  float* parts = num_parts ? malloc(sizeof(float) * num_parts * group * (head_size + 1)) : NULL;
  if (num_parts && parts == NULL) {
    free(splits);
    return -1;
  }
  float* lses = parts ? parts + num_parts * group * head_size : NULL;
#ifdef PAGEDLM_AMX
  const int use_amx = bf16 && kind == KV_BF16 && group <= 16 && block_size % 16 == 0 &&
                      (head_size == 64 || head_size == 128 || head_size == 256) && amx_permitted();
#endif
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    float* qf = malloc(sizeof(float) * group * head_size);
    float* acc = malloc(sizeof(float) * group * head_size);
    // token-major scores: 16 heads wide (AMX) or group rounded up to 8; 32 rows of slack, as
    // AMX scores whole aligned runs of 16 from below a split's start to above its end
    const int64_t width = group <= 16 ? 16 : (group + 7) & ~(int64_t)7;
    float* scores = malloc(sizeof(float) * width * (max_piece + 32));
    float* row = malloc(sizeof(float) * head_size);
#ifdef PAGEDLM_AMX
    uint16_t* qb = malloc(sizeof(uint16_t) * 16 * head_size);
    if (use_amx && qb != NULL) amx_configure();
    const int ok = qf && acc && scores && row && qb;
#else
    const int ok = qf && acc && scores && row;
#endif
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < num_items; item++) {
      if (!ok) continue;
      int64_t b = 0, hi_b = num_seqs;  // first_item[b] <= item < first_item[b + 1]
      while (hi_b - b > 1) {
        const int64_t mid = (b + hi_b) / 2;
        if (first_item[mid] <= item) b = mid;
        else hi_b = mid;
      }
      const int64_t local = item - first_item[b];
      const int64_t kh = local / splits[b], sp = local % splits[b];
      int64_t lo, hi;
      split_range(seq_lens[b], window, sp, splits[b], &lo, &hi);
      float *part = NULL, *lse = NULL;
      if (splits[b] > 1) {
        const int64_t pi = first_part[b] + local;
        part = parts + pi * group * head_size;
        lse = lses + pi * group;
      }
      const int64_t* table = block_table + b * max_blocks;
#define ATTEND(D)                                                                            \
  attend(q, k_cache, v_cache, table, lo, hi, out, b, kh, num_heads, group, D, token_stride,   \
         block_size, scale, bf16, &kv, part, lse, qf, acc, scores, row)
#define ATTEND_AVX512(DV)                                                                    \
  attend_avx512(q, k_cache, v_cache, table, lo, hi, out, b, kh, num_heads, group, DV,         \
                token_stride, block_size, scale, bf16, &kv, part, lse, qf, scores, row)
#define ATTEND_AMX(DV)                                                                       \
  attend_amx(q, k_cache, v_cache, table, lo, hi, out, b, kh, num_heads, group, DV,            \
             token_stride, block_size, scale, &kv, part, lse, qb, scores, row)
#ifdef PAGEDLM_AMX
      if (use_amx) {
        switch (head_size) {
          case 64: ATTEND_AMX(4); break;
          case 128: ATTEND_AMX(8); break;
          default: ATTEND_AMX(16);
        }
        continue;
      }
#endif
      switch (head_size) {
#ifdef PAGEDLM_AVX512
        case 64: ATTEND_AVX512(4); break;
        case 128: ATTEND_AVX512(8); break;
        case 256: ATTEND_AVX512(16); break;
#endif
        default: ATTEND(head_size);
      }
#undef ATTEND
#undef ATTEND_AVX512
#undef ATTEND_AMX
    }
    // merge the splits of each (sequence, kv head): weights exp(lse_s - max lse)
#pragma omp for schedule(dynamic)
    for (int64_t bk = 0; bk < num_seqs * num_kv_heads; bk++) {
      const int64_t b = bk / num_kv_heads, kh = bk % num_kv_heads;
      if (!ok || splits[b] == 1) continue;
      const int64_t pi0 = first_part[b] + kh * splits[b];
      for (int64_t g = 0; g < group; g++) {
        float mx = -INFINITY, total = 0.f;
        for (int64_t sp = 0; sp < splits[b]; sp++) {
          const float l = lses[(pi0 + sp) * group + g];
          mx = l > mx ? l : mx;
        }
        memset(acc, 0, sizeof(float) * head_size);
        for (int64_t sp = 0; sp < splits[b]; sp++) {
          const float w = expf(lses[(pi0 + sp) * group + g] - mx);
          const float* p = parts + ((pi0 + sp) * group + g) * head_size;
          total += w;
#pragma omp simd
          for (int64_t x = 0; x < head_size; x++) acc[x] += w * p[x];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t x = 0; x < head_size; x++) acc[x] *= inv;
        store_row(out, (b * num_heads + kh * group + g) * head_size, head_size, bf16, acc);
      }
    }
#ifdef PAGEDLM_AMX
    if (use_amx && qb != NULL) _tile_release();
    free(qb);
#endif
    free(qf);
    free(acc);
    free(scores);
    free(row);
  }
  free(parts);
  free(splits);
  return failed ? -1 : 0;
}
