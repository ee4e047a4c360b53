// Greedy sampling: the first index of each row's maximum, for bf16 or fp32 logits.
// Two passes per row: a vectorized max, then a scan for the first element equal to it
// (rows holding NaN return the first NaN, as torch.argmax does).
#include "common.h"

void argmax_rows(const void* logits, int64_t num_rows, int64_t vocab, int bf16,
                 int64_t* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t r = 0; r < num_rows; r++) {
    float row[1024];
    float mx = -INFINITY;
    int has_nan = 0;
    for (int64_t c0 = 0; c0 < vocab; c0 += 1024) {
      const int64_t n = vocab - c0 < 1024 ? vocab - c0 : 1024;
      load_row(logits, r * vocab + c0, n, bf16, row);
#pragma omp simd reduction(max : mx) reduction(| : has_nan)
      for (int64_t i = 0; i < n; i++) {
        mx = row[i] > mx ? row[i] : mx;
        has_nan |= row[i] != row[i];
      }
    }
    int64_t best = 0;
    for (int64_t c0 = 0; c0 < vocab; c0 += 1024) {
      const int64_t n = vocab - c0 < 1024 ? vocab - c0 : 1024;
      load_row(logits, r * vocab + c0, n, bf16, row);
      int64_t found = -1;
      for (int64_t i = 0; i < n; i++) {
        if (has_nan ? row[i] != row[i] : row[i] == mx) {
          found = i;
          break;
        }
      }
      if (found >= 0) {
        best = c0 + found;
        break;
      }
    }
    out[r] = best;
  }
}
