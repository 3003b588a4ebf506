// CPU FlexAttention tile products (the hot loops of kernels/cpu/attention_impl.h), compiled for
// x86-64-v3 (AVX2+FMA) and for the baseline ISA and picked at load time by CPU features
// (target_clones). Each product is register-blocked: a kR x kC block of the output stays in
// registers over the whole reduction (kC floats = two AVX2 vectors), and every output element
// sums its terms in increasing reduction index, exactly as the plain loops did.
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

namespace {
constexpr int64_t kR = 4;   // output rows per register block
constexpr int64_t kC = 16;  // output columns per register block
}  // namespace

// s[i * ld + j] = sum_e a[i * n + e] * bt[e * ld + j] for i < m, j < nk.
KILN_FLEX_CLONES void tile_abt(float* s, int64_t ld, const float* a, int64_t m, int64_t n, const float* bt, int64_t nk) {
  KILN_SVE_SEAM(tile_abt, s, ld, a, m, n, bt, nk);
  int64_t i0 = 0;
  for (; i0 + kR <= m; i0 += kR) {
    int64_t j0 = 0;
    for (; j0 + kC <= nk; j0 += kC) {
      float c[kR][kC] = {};
      for (int64_t e = 0; e < n; ++e) {
        const float* b = bt + e * ld + j0;
        for (int64_t r = 0; r < kR; ++r) {
          const float ar = a[(i0 + r) * n + e];
#pragma omp simd
          for (int64_t j = 0; j < kC; ++j) c[r][j] += ar * b[j];
        }
      }
      for (int64_t r = 0; r < kR; ++r) std::copy(c[r], c[r] + kC, s + (i0 + r) * ld + j0);
    }
    for (int64_t i = i0; i < i0 + kR; ++i)  // column tail
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

// acc[i * n + :] += sum_k w(i, k) · x[k * n + :] for i < out_rows, k < k_len, with
// w(i, k) = w[i * w_out + k * w_sum]: register blocks of kR output rows × kC columns, then the
// column and row tails. Inlined into the two cloned entry points below (one body per target).
[[gnu::always_inline]] inline void tile_wx(float* acc, int64_t n, const float* w, int64_t w_out, int64_t w_sum,
                                           int64_t out_rows, const float* x, int64_t k_len) {
  int64_t r0 = 0;
  for (; r0 + kR <= out_rows; r0 += kR) {
    int64_t e0 = 0;
    for (; e0 + kC <= n; e0 += kC) {
      float c[kR][kC];
      for (int64_t r = 0; r < kR; ++r) std::copy(acc + (r0 + r) * n + e0, acc + (r0 + r) * n + e0 + kC, c[r]);
      for (int64_t k = 0; k < k_len; ++k) {
        const float* xk = x + k * n + e0;
        for (int64_t r = 0; r < kR; ++r) {
          const float wk = w[(r0 + r) * w_out + k * w_sum];
#pragma omp simd
          for (int64_t e = 0; e < kC; ++e) c[r][e] += wk * xk[e];
        }
      }
      for (int64_t r = 0; r < kR; ++r) std::copy(c[r], c[r] + kC, acc + (r0 + r) * n + e0);
    }
    for (int64_t r = r0; r < r0 + kR; ++r)  // column tail
      for (int64_t k = 0; k < k_len; ++k)
        for (int64_t e = e0; e < n; ++e) acc[r * n + e] += w[r * w_out + k * w_sum] * x[k * n + e];
  }
  for (int64_t r = r0; r < out_rows; ++r) {  // row tail
    float* ar = acc + r * n;
    for (int64_t k = 0; k < k_len; ++k) {
      const float wk = w[r * w_out + k * w_sum];
      const float* xk = x + k * n;
#pragma omp simd
      for (int64_t e = 0; e < n; ++e) ar[e] += wk * xk[e];
    }
  }
}

// acc[r * n + :] += sum_c w[r * ld + c] * x[c * n + :] (w indexed by (row, col)).
KILN_FLEX_CLONES void tile_ax(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols) {
  KILN_SVE_SEAM(tile_ax, acc, n, w, ld, rows, x, cols);
  tile_wx(acc, n, w, ld, 1, rows, x, cols);
}

// acc[c * n + :] += sum_r w[r * ld + c] * x[r * n + :] (the transposed product).
KILN_FLEX_CLONES void tile_atx(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols) {
  KILN_SVE_SEAM(tile_atx, acc, n, w, ld, rows, x, cols);
  tile_wx(acc, n, w, 1, ld, cols, x, rows);
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
