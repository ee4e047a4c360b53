// Prefill attention over the paged KV cache: tiled, online softmax (flash-attention style).
//
// Every prefill chunk reads its keys and values straight from the cache through the block table
// (the chunk's own keys are written there first), cached prefix or not. Causal masks are
// bottom-right aligned: query row i of a chunk of n tokens in a sequence of seq_len sits at
// position seq_len - n + i and sees keys at positions <= its own (and > its own - window with a
// sliding window). Work items are (request, kv head, tile of query tokens); an item holds the
// rows (token, query head of the kv head's group) of its tile, walks the key range its rows can
// see in tiles of KT keys, converts each key/value tile once into a packed scratch layout and
// keeps a running (AVX-512: lazy reference) max, sum and fp32 accumulator per row; per tile,
// blocks of RB_ROWS rows take scores, softmax and P.V in turn, so that their scores stay in L1.
// Memory: O(rows x head_size + KT x head_size) per thread; no mask and no gathered copy of the
// context exists.
//
// Five inner paths share this structure: portable C (any head size), AVX-512 in fp32
// (head_size % 16 == 0), AVX-512 BF16 dot products (bf16 queries, bf16 or fp8 cache,
// head_size 64 / 128 / 256), the same with AMX tile products for the scores and the weighted
// values (blocks of 16 rows) and, without AVX-512, AVX2 in fp32 (head_size % 16 == 0); the
// vector paths are specialized for the common head sizes.
#include <stdlib.h>

#include "common.h"
#include "paged_prefill_avx2.h"
#include "paged_prefill_amx.h"  // includes paged_prefill_bf16.h and paged_prefill_tiles.h

// Rows (query token x head of the group) per work item: each key tile is packed once per item,
// so larger items pack less (1024 against 512, one layer of a 4096-token prompt: 22.7 -> 21.8
// ms at 14/2 heads x 64, 29.4 -> 27.8 at 12/2 x 128, 39.1 -> 36.8 at 16/2 x 128; 512-token
// chunks after 4096 and 16384 cached tokens ~7% faster; attention_micro.py, Sapphire Rapids).
#define ITEM_ROWS 1024

// Keys of the tile (from t0, kn of them) that the last row of the block rb .. rb + RB - 1 can
// see, rounded up to two vectors: on the causal diagonal the vector paths stop there (the
// rest would be masked out).
static inline int block_keys(int64_t first_q, int64_t rows, int64_t G, int64_t t0, int kn,
                             int64_t rb, int64_t RB) {
  const int64_t last = (rb + RB < rows ? rb + RB : rows) - 1;
  const int64_t seen = first_q + last / G - t0 + 1;
  return seen >= kn ? kn : seen <= 0 ? 32 : (int)((seen + 31) & ~(int64_t)31);
}

// ---------------------------------------------------------------- one work item
// PATH 0: portable, 1: AVX-512 fp32, 2: AVX-512 BF16, 3: AVX2 fp32, 4: AMX. DV = head_size /
// 16 for paths 1, 2 and 4, head_size / 8 for path 3.
static inline __attribute__((always_inline)) void attend_tile(const Args* a, Scratch* s,
                                                              int64_t req, int64_t kh,
                                                              int64_t i0, int64_t i1,
                                                              const int PATH, const int DV) {
  const int64_t d = a->head_size, G = a->group;
  const int64_t q_start = a->query_start_loc[req];
  const int64_t q_len = a->query_start_loc[req + 1] - q_start;
  const int64_t seq_len = a->seq_lens[req];
  const int64_t pos0 = seq_len - q_len;  // position of the chunk's first query
  const int64_t* table = a->block_table + req * a->max_blocks;
  const int64_t rows = (i1 - i0) * G;
  const int64_t RB = PATH == 4 ? RB_AMX : RB_ROWS;  // rows per block
  const int64_t rows_pad = (rows + RB - 1) / RB * RB;  // whole row blocks
  const int BF16 = PATH == 2 || PATH == 4;  // bf16 packing, queries and probabilities
  // The vector paths keep scores in base 2 (scale * log2(e) folded in, exp2 in the softmax).
  const float scale = PATH == 0 ? a->scale : a->scale * 1.4426950408889634f;
  // queries: prescaled fp32, or raw bf16 pairs (the BF16 softmax applies the scale)
  for (int64_t r = 0; r < rows_pad; r++) {
    if (r >= rows) {
      if (BF16)
        memset(s->qb + r * (d / 2), 0, sizeof(uint32_t) * (d / 2));
      else
        memset(s->qf + r * d, 0, sizeof(float) * d);
      continue;
    }
    const int64_t off = (q_start + i0 + r / G) * a->q_stride + (kh * G + r % G) * d;
    if (BF16) {
      memcpy(s->qb + r * (d / 2), (const uint16_t*)a->q + off, sizeof(uint16_t) * d);
    } else {
      load_row(a->q, off, d, a->bf16, s->qf + r * d);
      for (int64_t x = 0; x < d; x++) s->qf[r * d + x] *= scale;
    }
  }
  for (int64_t r = 0; r < rows_pad; r++) s->m[r] = -INFINITY;
  memset(s->l, 0, sizeof(float) * 16 * rows_pad);
  memset(s->acc, 0, sizeof(float) * rows_pad * d);
  const int64_t first_q = pos0 + i0, last_q = pos0 + i1 - 1;
  const int64_t lo = a->window > 0 && first_q - a->window + 1 > 0 ? first_q - a->window + 1 : 0;
  const int64_t hi = last_q + 1;  // keys lo .. hi - 1
  for (int64_t t0 = lo; t0 < hi; t0 += KT) {
    // keys of this tile rounded up to two vectors: the last tile skips its empty vectors
    const int kn = hi - t0 >= KT ? KT : (int)((hi - t0 + 31) & ~(int64_t)31);
#ifdef PAGEDLM_PREFILL_BF16
    if (BF16) pack_bf16(a, table, kh, t0, hi, (uint32_t*)s->kt, (uint16_t*)s->vf, DV, kn);
#endif
#ifdef PAGEDLM_AVX512
    if (PATH == 1) pack_f32_avx512(a, table, kh, t0, hi, s->kt, s->vf, DV, kn);
#endif
#ifdef PAGEDLM_PREFILL_AVX2
    if (PATH == 3) pack_f32_avx2(a, table, kh, t0, hi, s->kt, s->vf, DV, kn);
#endif
    if (PATH == 0) pack_f32(a, table, kh, t0, hi, s->kt, s->vf, s->acc + rows_pad * d);
    // Row blocks: scores, softmax and P.V of RB rows while their scores are in L1.
    for (int64_t rb = 0; rb < rows_pad; rb += RB) {
      const int kb = block_keys(first_q, rows, G, t0, kn, rb, RB);
#ifdef PAGEDLM_PREFILL_BF16
      if (PATH == 2) qk_bf16(s->qb + rb * (d / 2), (const uint32_t*)s->kt, s->p, RB_ROWS, DV, kb);
#endif
#ifdef PAGEDLM_PREFILL_AMX
      if (PATH == 4 && rb == 0) qk_amx(s->qb, (const uint32_t*)s->kt, s->p, DV, kb);
#endif
#ifdef PAGEDLM_AVX512
      if (PATH == 1) qk_f32_avx512(s->qf + rb * d, s->kt, s->p, RB_ROWS, DV, kb);
#endif
#ifdef PAGEDLM_PREFILL_AVX2
      if (PATH == 3) qk_f32_avx2(s->qf + rb * d, s->kt, s->p, DV, kb);
#endif
      if (PATH == 0) qk_f32(s->qf + rb * d, s->kt, s->p, RB_ROWS, d);
      for (int64_t r = rb; r < rb + RB; r++) {
        int64_t jlo = 0, jhi = -1;  // padded rows see nothing
        if (r < rows) {
          const int64_t qpos = first_q + r / G;
          const int64_t klo = a->window > 0 ? qpos - a->window + 1 : 0;
          jlo = klo > t0 ? klo - t0 : 0;
          jhi = qpos - t0 < KT - 1 ? qpos - t0 : KT - 1;
        }
        float* pr = s->p + (r - rb) * KP;
#ifdef PAGEDLM_PREFILL_BF16
        if (BF16) {
          uint16_t* pbr = (uint16_t*)(s->pb + (r - rb) * (PBP / 2));
          softmax_row_bf16(s, pr, pbr, r, jlo, jhi, kb, scale);
          continue;
        }
#endif
#ifdef PAGEDLM_AVX512
        if (PATH == 1) {
          softmax_row_avx512(s, pr, r, jlo, jhi, kb);
          continue;
        }
#endif
#ifdef PAGEDLM_PREFILL_AVX2
        if (PATH == 3) {
          softmax_row_avx2(s, pr, r, jlo, jhi, kb);
          continue;
        }
#endif
        softmax_row(s, pr, r, jlo, jhi);
      }
#ifdef PAGEDLM_PREFILL_BF16
      if (PATH == 2) pv_bf16(s, (const uint16_t*)s->vf, rb, DV, kb);
#endif
#ifdef PAGEDLM_PREFILL_AMX
      if (PATH == 4) {
        // the next block's scores first (this block's softmax is done with p): the tile
        // products run while the probabilities' stores drain, which pv_amx's tile loads of
        // them wait for
        if (rb + RB < rows_pad)
          qk_amx(s->qb + (rb + RB) * (d / 2), (const uint32_t*)s->kt, s->p, DV,
                 block_keys(first_q, rows, G, t0, kn, rb + RB, RB));
        pv_amx(s, (const uint16_t*)s->vf, rb, DV, kb);
      }
#endif
#ifdef PAGEDLM_AVX512
      if (PATH == 1) pv_f32_avx512(s, s->vf, rb, DV, kb);
#endif
#ifdef PAGEDLM_PREFILL_AVX2
      if (PATH == 3) pv_f32_avx2(s, s->vf, rb, DV, kb);
#endif
      if (PATH == 0) pv_f32(s, s->vf, rb, d);
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    float* acc = s->acc + r * d;
    float l = 0.f;
    for (int x = 0; x < 16; x++) l += s->l[16 * r + x];
    const float inv = 1.f / l;  // l >= 1: every row sees its own position
    for (int64_t x = 0; x < d; x++) acc[x] *= inv;
    const int64_t token = q_start + i0 + r / G;
    store_row(a->out, (token * a->num_heads + kh * G + r % G) * d, d, a->bf16, acc);
  }
}

static void attend_item(const Args* a, Scratch* s, int path, int64_t req, int64_t kh, int64_t i0,
                        int64_t i1) {
#define TILE(P, DV) attend_tile(a, s, req, kh, i0, i1, P, DV)
// the bf16 paths take head sizes 64, 128 and 256 (DV: 16-value vectors a row)
#define TILE_BF16(P)                                 \
  do {                                               \
    if (a->head_size == 64) TILE(P, 4);              \
    else if (a->head_size == 128) TILE(P, 8);        \
    else TILE(P, 16);                                \
    return;                                          \
  } while (0)
#ifdef PAGEDLM_PREFILL_AMX
  if (path == 4) TILE_BF16(4);
#endif
#ifdef PAGEDLM_PREFILL_BF16
  if (path == 2) TILE_BF16(2);
#endif
#ifdef PAGEDLM_AVX512
  if (path == 1) {
    switch (a->head_size) {
      case 64: TILE(1, 4); return;
      case 128: TILE(1, 8); return;
      case 256: TILE(1, 16); return;
      case 32: TILE(1, 2); return;
      case 16: TILE(1, 1); return;
      default: break;
    }
  }
#endif
#ifdef PAGEDLM_PREFILL_AVX2
  if (path == 3) {
    switch (a->head_size) {
      case 64: TILE(3, 8); return;
      case 128: TILE(3, 16); return;
      case 256: TILE(3, 32); return;
      default: TILE(3, (int)(a->head_size / 8)); return;
    }
  }
#endif
  TILE(0, 0);
#undef TILE_BF16
#undef TILE
}

// Query rows [query_start_loc[r], query_start_loc[r + 1]) of request r attend positions
// 0 .. seq_lens[r] - 1 of its sequence. q rows are q_stride elements apart (heads contiguous);
// out is [rows, num_heads, head_size]. Returns 0, or -1 when scratch memory ran out.
int paged_prefill_attention(const void* q, int64_t q_stride, const void* k_cache,
                            const void* v_cache, const int64_t* block_table, int64_t max_blocks,
                            const int64_t* query_start_loc, const int64_t* seq_lens, void* out,
                            int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_size, int64_t block_size, float scale, int64_t window,
                            int bf16, int kind, float k_scale, float v_scale, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const Args a = {q,          k_cache,         v_cache,       block_table,
                  query_start_loc, seq_lens,   out,           max_blocks,
                  num_heads,  num_kv_heads,    head_size,     block_size,
                  window,     q_stride,        group,         num_kv_heads * head_size,
                  scale,      k_scale,         v_scale,       bf16,
                  kind};
  int path = 0;
#ifdef PAGEDLM_PREFILL_AVX2
  if (head_size % 16 == 0) path = 3;
#endif
#ifdef PAGEDLM_AVX512
  if (head_size % 16 == 0 && head_size <= 256 && (head_size & (head_size - 1)) == 0) path = 1;
#endif
#ifdef PAGEDLM_PREFILL_BF16
  if (bf16 && kind != KV_F32 && (head_size == 64 || head_size == 128 || head_size == 256))
    path = 2;
#endif
#ifdef PAGEDLM_PREFILL_AMX
  if (path == 2 && amx_permitted()) path = 4;
#endif
  // Query tokens per item: about ITEM_ROWS rows (each key tile's packing serves them all),
  // fewer while there are too few items for the threads.
  int64_t tile = ITEM_ROWS / group > 1 ? ITEM_ROWS / group : 1;
  tile = tile > ITEM_ROWS / 4 ? ITEM_ROWS / 4 : tile;
  int64_t num_items = 0;
  for (;;) {
    num_items = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
      const int64_t n = query_start_loc[r + 1] - query_start_loc[r];
      num_items += (n + tile - 1) / tile * num_kv_heads;
    }
    if (tile == 1 || num_items >= 4 * num_threads) break;
    tile /= 2;
  }
  int64_t* first_item = malloc(sizeof(int64_t) * (num_reqs + 1));
  if (first_item == NULL) return -1;
  first_item[0] = 0;
  for (int64_t r = 0; r < num_reqs; r++) {
    const int64_t n = query_start_loc[r + 1] - query_start_loc[r];
    first_item[r + 1] = first_item[r] + (n + tile - 1) / tile * num_kv_heads;
  }
  const int64_t rows_cap = (tile * group + RB_AMX - 1) / RB_AMX * RB_AMX;  // whole row blocks
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch s;
    const int64_t d = head_size;
    s.rows_cap = rows_cap;
    // acc has one more row of slack: the portable packer's conversion row
    s.acc = alloc_lines(sizeof(float) * (rows_cap + 1) * d);
    s.m = alloc_lines(sizeof(float) * rows_cap);
    s.l = alloc_lines(sizeof(float) * rows_cap * 16);
    s.alpha = alloc_lines(sizeof(float) * rows_cap);
    s.p = alloc_lines(sizeof(float) * RB_AMX * KP);  // a block of RB_ROWS or RB_AMX rows
    s.pb = alloc_lines(sizeof(uint32_t) * RB_AMX * PBP / 2);
    s.kt = alloc_lines(sizeof(float) * d * KP);
    s.vf = alloc_lines(sizeof(float) * d * KT);
    s.qf = alloc_lines(sizeof(float) * rows_cap * d);
    s.qb = alloc_lines(sizeof(uint32_t) * rows_cap * d / 2 + 4);
    const int ok = s.acc && s.m && s.l && s.alpha && s.p && s.pb && s.kt && s.vf && s.qf && s.qb;
#ifdef PAGEDLM_PREFILL_AMX
    if (path == 4) prefill_amx_configure();
#endif
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; it++) {
      if (!ok) continue;
      const int64_t item = num_items - 1 - it;  // the last tiles see the most keys: first
      int64_t lo = 0, hi = num_reqs;  // request: first_item[req] <= item < first_item[req + 1]
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (first_item[mid] <= item) lo = mid;
        else hi = mid;
      }
      const int64_t req = lo, local = item - first_item[req];
      const int64_t kh = local % num_kv_heads, t = local / num_kv_heads;
      const int64_t n = query_start_loc[req + 1] - query_start_loc[req];
      const int64_t i0 = t * tile, i1 = i0 + tile < n ? i0 + tile : n;
      attend_item(&a, &s, path, req, kh, i0, i1);
    }
#ifdef PAGEDLM_PREFILL_AMX
    if (path == 4) _tile_release();
#endif
    free(s.acc);
    free(s.m);
    free(s.l);
    free(s.alpha);
    free(s.p);
    free(s.pb);
    free(s.kt);
    free(s.vf);
    free(s.qf);
    free(s.qb);
  }
  free(first_item);
  return failed ? -1 : 0;
}
