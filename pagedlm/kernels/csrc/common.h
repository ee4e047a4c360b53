// Shared helpers for the CPU kernels: bf16 <-> fp32 rows and a vectorizable exp.
// Every loop here is written so that gcc -O3 -march=native vectorizes it (no intrinsics).
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Row of n values (bf16 when `bf16`, else fp32) starting at element `offset` -> fp32.
static inline void load_row(const void* base, int64_t offset, int64_t n, int bf16,
                            float* restrict row) {
  if (bf16) {
    const uint16_t* restrict src = (const uint16_t*)base + offset;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
      const uint32_t bits = ((uint32_t)src[i]) << 16;  // memcpy: no strict-aliasing type pun
      memcpy(row + i, &bits, 4);
    }
  } else {
    memcpy(row, (const float*)base + offset, sizeof(float) * n);
  }
}

// Scratch of n bytes from a cache-line boundary, a whole number of lines (free() releases it).
// An AMX tile row or a 64-byte vector that straddles two lines loads (or stores) both: with
// glibc's malloc (16-byte aligned) the AMX prefill attention ran ~1.5x slower.
static inline void* alloc_lines(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

// KV cache element kinds: the cache may be narrower than the queries (fp8 with a per-tensor
// scale: value = fp8 * scale, as vLLM's k_scale / v_scale).
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8_E4M3 = 2, KV_FP8_E5M2 = 3 };

static inline int64_t kv_elem_bytes(int kind) {
  return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1;
}

// One fp8 byte -> fp32, exactly: the exponent and mantissa bits are placed in an fp32 and
// rebiased with one multiplication (subnormals come out right the same way). e4m3fn's NaN
// (0x7F / 0xFF) is not produced by the cache writes, which saturate.
static inline float fp8_to_f32(uint8_t b, int kind) {
  const uint32_t sign = (uint32_t)(b & 0x80) << 24, em = b & 0x7Fu;
  uint32_t bits;
  float f;
  if (kind == KV_FP8_E4M3) {
    bits = sign | (em << 20);
    memcpy(&f, &bits, 4);
    return f * 0x1p120f;
  }
  if ((em >> 2) == 31) {  // e5m2 inf / NaN
    bits = sign | 0x7F800000u | (em & 3u) << 21;
    memcpy(&f, &bits, 4);
    return f;
  }
  bits = sign | (em << 21);
  memcpy(&f, &bits, 4);
  return f * 0x1p112f;
}

// n cache values of any kind starting at element `offset` -> fp32 (fp8 times `scale`).
static inline void load_kv_row(const void* base, int64_t offset, int64_t n, int kind, float scale,
                               float* restrict row) {
  if (kind == KV_F32 || kind == KV_BF16) {
    load_row(base, offset, n, kind == KV_BF16, row);
    return;
  }
  const uint8_t* restrict src = (const uint8_t*)base + offset;
  for (int64_t i = 0; i < n; i++) row[i] = fp8_to_f32(src[i], kind) * scale;
}

// fp32 -> bf16, rounding to nearest even as PyTorch does (NaN stays NaN).
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

// The fp32 value of to_bf16(f): rounding in registers, so chains of bf16 ops match PyTorch.
static inline float round_bf16(float f) {
  const uint32_t u = ((uint32_t)to_bf16(f)) << 16;
  float r;
  memcpy(&r, &u, 4);
  return r;
}

static inline void store_row(void* base, int64_t offset, int64_t n, int bf16,
                             const float* restrict row) {
  if (bf16) {
    uint16_t* restrict dst = (uint16_t*)base + offset;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(row[i]);
  } else {
    memcpy((float*)base + offset, row, sizeof(float) * n);
  }
}

// e^x within ~2 ulp for x in [-87, 88] (Cephes-style reduction, degree-6 polynomial); inputs
// outside are clamped to that range.
static inline float exp_clamped(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  const float n = floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const union {
    int32_t i;
    float f;
  } scale = {.i = ((int32_t)n + 127) << 23};  // 2^n
  return p * scale.f;
}

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // every x86 SIMD path (AVX2 included) takes its intrinsics from here
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDLM_AVX512 1

static inline __m512 load16(const void* base, int64_t offset, int bf16) {
  if (bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps((const float*)base + offset);
}

// 16 cache values of any kind -> fp32 (fp8 times `scale`). fp8 goes through fp16, whose
// conversion is exact and handles subnormals in hardware: e5m2 is the top byte of an fp16, e4m3
// is an fp16 with its exponent 8 too small.
static inline __m512 load16_kv(const void* base, int64_t offset, int kind, float scale) {
  if (kind == KV_F32 || kind == KV_BF16) return load16(base, offset, kind == KV_BF16);
  const __m256i w =
      _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)((const uint8_t*)base + offset)));
  if (kind == KV_FP8_E5M2)
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(w, 8)), _mm512_set1_ps(scale));
  const __m256i h =
      _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f * scale));
}

// exp_clamped on 16 lanes (exp_clamped itself does not vectorize: gcc 12 if-converts its clamps
// only with -ffinite-math-only).
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 2^x on 16 lanes: 2^n * p(x - n), n = round(x), p the degree-7 Taylor polynomial of
// e^(r ln 2) on |r| <= 1/2 (relative error < 1e-8); x below -150 (-inf included) gives 0.
// Ten operations against exp512's fifteen (softmaxes in base 2 and SiLU use it).
static inline __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 fp32 lanes as bf16 bits, rounded to nearest even; NaN stays NaN. With AVX-512 BF16 one
// vcvtneps2bf16, which also flushes fp32 denormals (|x| < 2^-126) to zero.
static inline __m256i bf16_bits512(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

// Round 16 fp32 lanes to bf16 precision, keeping them fp32 (as bf16_bits512).
static inline __m512 round512_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits512(x)), 16));
}

// silu(g) * u on 16 lanes, the silu rounded to bf16 first where the tensors are bf16 (as
// PyTorch's bf16 silu then mul): silu_and_mul, and int8_gemm_amx's fused form of it.
static inline __m512 silu_mul512(__m512 g, __m512 u, int bf16) {
  const __m512 e = exp2_512(_mm512_mul_ps(g, _mm512_set1_ps(-1.4426950408889634f)));
  __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  if (bf16) s = round512_bf16(s);
  return _mm512_mul_ps(s, u);
}

// Store 16 lanes as bf16 (rounded) or fp32.
static inline void store16(void* base, int64_t offset, __m512 x, int bf16) {
  if (bf16)
    _mm256_storeu_si256((__m256i*)((uint16_t*)base + offset), bf16_bits512(x));
  else
    _mm512_storeu_ps((float*)base + offset, x);
}

// The first n of 16 lanes (none for n <= 0, all for n >= 16).
static inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

// store16 of the lanes in `lanes` only.
static inline void store16_lanes(void* base, int64_t offset, __m512 x, int bf16, __mmask16 lanes) {
  if (bf16)
    _mm256_mask_storeu_epi16((uint16_t*)base + offset, lanes, bf16_bits512(x));
  else
    _mm512_mask_storeu_ps((float*)base + offset, lanes, x);
}

// In-place transpose of a 16 x 16 fp32 matrix held in 16 registers.
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}
#endif

#if defined(PAGEDLM_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// Set by set_amx_disabled (kernels/cpu.py, from PAGEDLM_DISABLE_AMX): the AVX-512 paths then
// run where AMX would, as on CPUs without it (their tests run that way on AMX machines too).
extern int pagedlm_amx_disabled;

// Linux grants AMX tile state to a process only on request (oneDNN makes the same request).
static inline int amx_permitted(void) {
  static int state = -1;
  if (pagedlm_amx_disabled) return 0;
  if (state < 0)
    state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                    18 /* XFEATURE_XTILEDATA */) == 0;
  return state;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

// Tiles 0 .. count - 1 as 16 rows of 64 bytes (the largest tile), for this thread.
static inline void amx_configure_full_tiles(int count) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int i = 0; i < count; i++) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

#endif
