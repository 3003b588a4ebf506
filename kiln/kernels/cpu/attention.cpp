// CPU FlexAttention tile products S = A·Bᵀ and the row loops (the hot loops of
// kernels/cpu/attention_impl.h; the accumulating products tile_ax / tile_atx are
// attention_wx.cpp's), compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2+FMA) and the baseline
// ISA and picked at load time by CPU features (target_clones). Each product is register-blocked:
// a kTileRows x kTileCols block of the output stays in registers over the whole reduction
// (kTileCols floats = two AVX2 vectors, one AVX-512 vector), and every output element sums its
// terms in increasing reduction index, exactly as the plain loops did.
// No FP-exception traps are observed: lets GCC if-convert (and so vectorise) the clamps in
// fast_expf. Results are unchanged. Set before every include, so that every function of this
// file has the same options (a mismatch would stop inlining).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
// No FMA contraction either: a*b+c rounds as in the baseline clone, so Δ = rowsum(dO ∘ O) and
// dP = dO·Vᵀ cancel exactly where P is one-hot (a window of 1 gives exactly zero dQ/dK).
#pragma GCC optimize("fp-contract=off")
#endif
#include <algorithm>
#include <cstdint>

#include "kiln/kernels/cpu/attention_impl.h"
#include "kiln/kernels/cpu/isa/isa.h"  // KILN_SVE_SEAM: the SVE set on aarch64, nothing on x86

namespace kiln::kernels::cpu::flex_detail {

#define KILN_FLEX_CLONES KILN_CPU_CLONES  // kernels/cpu/vec_math.h

// s[i * ld + j] = sum_e a[i * n + e] * bt[e * ld + j] for i < m, j < nk.
KILN_FLEX_CLONES void tile_abt(float* s, int64_t ld, const float* a, int64_t m, int64_t n, const float* bt, int64_t nk) {
  KILN_SVE_SEAM(tile_abt, s, ld, a, m, n, bt, nk);
  int64_t i0 = 0;
  for (; i0 + kTileRows <= m; i0 += kTileRows) {
    int64_t j0 = 0;
    for (; j0 + kTileCols <= nk; j0 += kTileCols) {
      float c[kTileRows][kTileCols] = {};
      for (int64_t e = 0; e < n; ++e) {
        const float* b = bt + e * ld + j0;
        for (int64_t r = 0; r < kTileRows; ++r) {
          const float ar = a[(i0 + r) * n + e];
#pragma omp simd
          for (int64_t j = 0; j < kTileCols; ++j) c[r][j] += ar * b[j];
        }
      }
      for (int64_t r = 0; r < kTileRows; ++r) std::copy(c[r], c[r] + kTileCols, s + (i0 + r) * ld + j0);
    }
    for (int64_t i = i0; i < i0 + kTileRows; ++i)  // column tail
      for (int64_t j = j0; j < nk; ++j) {
        float acc = 0.0f;
        for (int64_t e = 0; e < n; ++e) acc += a[i * n + e] * bt[e * ld + j];
        s[i * ld + j] = acc;
      }
  }
  for (int64_t i = i0; i < m; ++i) {  // row tail
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

}  // namespace kiln::kernels::cpu::flex_detail

namespace kiln::kernels::cpu::flex_detail {

KILN_FLEX_CLONES float row_dot(const float* a, const float* b, int64_t n) {
  KILN_SVE_SEAM(row_dot, a, b, n);
  float d = 0.0f;
  for (int64_t e = 0; e < n; ++e) d += a[e] * b[e];
  return d;
}

KILN_FLEX_CLONES float row_max(const float* s, int64_t n) {
  KILN_SVE_SEAM(row_max, s, n);
  float mx = kNegInf;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  return mx;
}

KILN_FLEX_CLONES float row_exp_sum(float* s, int64_t n, float m) {
  KILN_SVE_SEAM(row_exp_sum, s, n, m);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = fast_expf(s[j] - m);
    sum += s[j];
  }
  return sum;
}

KILN_FLEX_CLONES void row_softmax_grad(float* s, float* d, int64_t n, float lse, float delta) {
  KILN_SVE_SEAM(row_softmax_grad, s, d, n, lse, delta);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float p = fast_expf(s[j] - lse);
    s[j] = p;
    d[j] = p * (d[j] - delta);
  }
}

}  // namespace kiln::kernels::cpu::flex_detail
