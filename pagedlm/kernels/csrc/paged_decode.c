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
// them against its group of query heads and takes a softmax, all in fp32 (the AVX-512 path in
// pieces of 256 keys with a running max, streaming the next piece's keys into L2 while it
// weighs the current piece's values). Scratch buffers are per thread. Head sizes 64, 128 and
// 256 take an AVX-512 path where the compiler targets it; without AVX-512, head sizes that are
// multiples of 8 over fp32/bf16 caches take the AVX2 one; every size has the portable one.
#include <stdlib.h>

#include "common.h"
#include "paged_decode_avx2.h"
#include "paged_decode_avx512.h"

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

#define MAX_SPLITS 64

// Keys each sequence attends (its window's worth at most).
static inline int64_t attended(int64_t len, int64_t window) {
  return window > 0 && len > window ? window : len;
}

// Keys per split at most: an item's values are prefetched into L2 while its keys are scored,
// and past ~1024 keys (a 1.5B's 512-byte token rows: 512 KB of each) they no longer wait there
// for the weighted sum. 8 sequences x 4096 keys, every layer's cache cold, as in a decode step:
// 2.56 -> 2.09 ms a layer at 12/2 heads x 128, 1.28 -> 1.05 at 14/2 x 64 (Sapphire Rapids).
#define MAX_PIECE 1024

// Splits per sequence: about 4 items per thread in all, none longer than MAX_PIECE keys unless
// min_split says so, none shorter than min_split (so a batch of many short sequences is not
// split, and a long one is cut into pieces for every core).
void paged_decode_num_splits(const int64_t* seq_lens, int64_t num_seqs, int64_t num_kv_heads,
                             int64_t window, int64_t min_split, int num_threads, int64_t* splits) {
  int64_t total = 0;
  for (int64_t b = 0; b < num_seqs; b++) total += attended(seq_lens[b], window) * num_kv_heads;
  const int64_t target = 4 * (int64_t)num_threads;
  int64_t piece = (total + target - 1) / target;
  piece = piece < MAX_PIECE ? piece : MAX_PIECE;
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
  int use_amx = 0;
#ifdef PAGEDLM_AMX
  use_amx = bf16 && kind == KV_BF16 && group <= 16 && block_size % 16 == 0 &&
            (head_size == 64 || head_size == 128 || head_size == 256) && amx_permitted();
#endif
  // Where every head of a sequence fits one AMX score tile (16 columns), an item attends all
  // its kv heads: it reads whole token rows, as contiguous as the cache lays them out, rather
  // than one kv head's part of each row (1.4x the bandwidth on SPR). Items are then (sequence,
  // split) with all heads: as if the model had one kv head of num_heads query heads.
  const int fuse = use_amx && num_heads <= 16;
  const int64_t item_kv = fuse ? 1 : num_kv_heads, item_heads = num_heads / item_kv;
  int64_t* splits = malloc(sizeof(int64_t) * (3 * num_seqs + 1));
  if (splits == NULL) return -1;
  int64_t* first_item = splits + num_seqs;  // [num_seqs + 1]
  int64_t* first_part = first_item + num_seqs + 1;  // partial-row index, split sequences only
  paged_decode_num_splits(seq_lens, num_seqs, item_kv, window, min_split > 0 ? min_split : 256,
                          num_threads, splits);
  int64_t max_piece = 1, num_parts = 0;
  first_item[0] = 0;
  for (int64_t b = 0; b < num_seqs; b++) {
    const int64_t piece = (attended(seq_lens[b], window) + splits[b] - 1) / splits[b];
    max_piece = piece > max_piece ? piece : max_piece;
    first_item[b + 1] = first_item[b] + splits[b] * item_kv;
    first_part[b] = num_parts;
    if (splits[b] > 1) num_parts += splits[b] * item_kv;
  }
  const int64_t num_items = first_item[num_seqs];
  // per split item: [item_heads][head_size] normalized fp32 rows, then [item_heads]
  // log-sum-exps
  float* parts =
      num_parts ? malloc(sizeof(float) * num_parts * item_heads * (head_size + 1)) : NULL;
  if (num_parts && parts == NULL) {
    free(splits);
    return -1;
  }
  float* lses = parts ? parts + num_parts * item_heads * head_size : NULL;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    float* qf = malloc(sizeof(float) * item_heads * head_size);
    float* acc = malloc(sizeof(float) * item_heads * head_size);
    // scores: token-major and 16 heads wide for AMX, with 32 rows of slack (it scores whole
    // aligned runs of 16 from below a split's start to above its end); head-major for AVX-512
    // (rows of one piece, at most DECODE_PIECE) and the portable path (rows of max_piece)
    const int64_t width = group > 16 ? group : 16;
    float* scores = malloc(sizeof(float) * width * (max_piece + 32));
    float* row = malloc(sizeof(float) * head_size);
#ifdef PAGEDLM_AMX
    uint16_t* qb = malloc(sizeof(uint16_t) * 16 * head_size * (fuse ? num_kv_heads : 1));
    char* amx_scratch =
        use_amx ? alloc_lines(amx_values_scratch_bytes(max_piece + 32)) : NULL;
    if (use_amx && qb != NULL) amx_configure();
    const int ok = qf && acc && scores && row && qb && (amx_scratch || !use_amx);
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
        part = parts + pi * item_heads * head_size;
        lse = lses + pi * item_heads;
      }
      const int64_t* table = block_table + b * max_blocks;
#define ATTEND(D)                                                                            \
  attend(q, k_cache, v_cache, table, lo, hi, out, b, kh, num_heads, group, D, token_stride,   \
         block_size, scale, bf16, &kv, part, lse, qf, acc, scores, row)
#define ATTEND_AVX512(DV)                                                                    \
  attend_avx512(q, k_cache, v_cache, table, lo, hi, out, b, kh, num_heads, group, DV,         \
                token_stride, block_size, scale, bf16, &kv, part, lse, qf, scores, acc)
#define ATTEND_AVX2(BF16)                                                                    \
  attend_avx2(q, k_cache, v_cache, table, lo, hi, out, b, kh, num_heads, group, head_size,    \
              token_stride, block_size, scale, bf16, BF16, part, lse, qf, acc, scores)
#define ATTEND_AMX(DV)                                                                       \
  attend_amx(q, k_cache, v_cache, table, lo, hi, out, b, kh, fuse ? num_kv_heads : 1,        \
             num_heads, group, DV, token_stride, block_size, scale, part, lse, qb, scores,      \
             amx_scratch, acc)
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
#ifdef PAGEDLM_DECODE_AVX2
      if (head_size % 8 == 0 && (kind == KV_F32 || kind == KV_BF16)) {
        if (kind == KV_BF16) ATTEND_AVX2(1);
        else ATTEND_AVX2(0);
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
#undef ATTEND_AVX2
    }
    // merge the splits of each (sequence, kv head): weights exp(lse_s - max lse)
#pragma omp for schedule(dynamic)
    for (int64_t bk = 0; bk < num_seqs * item_kv; bk++) {
      const int64_t b = bk / item_kv, kh = bk % item_kv;
      if (!ok || splits[b] == 1) continue;
      const int64_t pi0 = first_part[b] + kh * splits[b];
      for (int64_t g = 0; g < item_heads; g++) {
        float mx = -INFINITY, total = 0.f;
        for (int64_t sp = 0; sp < splits[b]; sp++) {
          const float l = lses[(pi0 + sp) * item_heads + g];
          mx = l > mx ? l : mx;
        }
        memset(acc, 0, sizeof(float) * head_size);
        for (int64_t sp = 0; sp < splits[b]; sp++) {
          const float w = expf(lses[(pi0 + sp) * item_heads + g] - mx);
          const float* p = parts + ((pi0 + sp) * item_heads + g) * head_size;
          total += w;
#pragma omp simd
          for (int64_t x = 0; x < head_size; x++) acc[x] += w * p[x];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t x = 0; x < head_size; x++) acc[x] *= inv;
        store_row(out, (b * num_heads + kh * item_heads + g) * head_size, head_size, bf16, acc);
      }
    }
#ifdef PAGEDLM_AMX
    if (use_amx && qb != NULL) _tile_release();
    free(qb);
    free(amx_scratch);
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
