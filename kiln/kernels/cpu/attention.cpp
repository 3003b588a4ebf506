// CPU FlexAttention tile products (the hot loops of kernels/cpu/attention_impl.h), compiled for
// AVX2+FMA and for the baseline ISA and picked at load time (target_clones).
#include <cstdint>

#include "kiln/kernels/cpu/attention_impl.h"

namespace kiln::kernels::cpu::flex_detail {

// The tile products are compiled twice (AVX2+FMA and the baseline) and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define KILN_FLEX_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define KILN_FLEX_CLONES
#endif

// s[i * ld + j] = sum_e a[i * n + e] * bt[e * ld + j] for i < m, j < nk.
KILN_FLEX_CLONES void tile_abt(float* s, int64_t ld, const float* a, int64_t m, int64_t n, const float* bt, int64_t nk) {
  for (int64_t i = 0; i < m; ++i) {
    float* si = s + i * ld;
#pragma omp simd
    for (int64_t j = 0; j < nk; ++j) si[j] = 0.0f;
    const float* ai = a + i * n;
    for (int64_t e = 0; e < n; ++e) {
      const float ae = ai[e];
      const float* b = bt + e * ld;
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) si[j] += ae * b[j];
    }
  }
}
// acc[r * n + :] += sum_c w[r * ld + c] * x[c * n + :] (w indexed by (row, col)).
KILN_FLEX_CLONES void tile_ax(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* ar = acc + r * n;
    for (int64_t c = 0; c < cols; ++c) {
      const float wc = w[r * ld + c];
      if (wc == 0.0f) continue;
      const float* xc = x + c * n;
#pragma omp simd
      for (int64_t e = 0; e < n; ++e) ar[e] += wc * xc[e];
    }
  }
}
// acc[c * n + :] += sum_r w[r * ld + c] * x[r * n + :] (the transposed product).
KILN_FLEX_CLONES void tile_atx(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    for (int64_t c = 0; c < cols; ++c) {
      const float wc = w[r * ld + c];
      if (wc == 0.0f) continue;
      float* ac = acc + c * n;
#pragma omp simd
      for (int64_t e = 0; e < n; ++e) ac[e] += wc * xr[e];
    }
  }
}

}  // namespace kiln::kernels::cpu::flex_detail
