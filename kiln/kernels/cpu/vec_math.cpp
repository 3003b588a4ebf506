// Vectorised f32 loops of kernels/cpu/vec_math.h (see there). FP traps are never observed:
// no-trapping-math lets GCC if-convert fast_expf's clamps and vectorise (set before every
// include, so all functions of this file share the options and inline into each other).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "kiln/kernels/cpu/vec_math.h"

#include "kiln/kernels/cpu/isa/isa.h"  // KILN_SVE_SEAM: the SVE set on aarch64, nothing on x86

#include <cmath>

namespace kiln::kernels::cpu {

// σ(x) and 1 − σ(x) from e = exp(−|x|) ≤ 1 (no overflow, no cancellation in 1 − σ).
KILN_CPU_CLONES void silu_f32(float* y, const float* x, int64_t n, bool deriv) {
  KILN_SVE_SEAM(silu_f32, y, x, n, deriv);
  if (deriv) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float xi = x[i], e = fast_expf(-std::fabs(xi)), d = 1.0f / (1.0f + e);
      const float sg = xi >= 0.0f ? d : e * d, om = xi >= 0.0f ? e * d : d;
      y[i] = sg * (1.0f + xi * om);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float xi = x[i], e = fast_expf(-std::fabs(xi)), d = 1.0f / (1.0f + e);
      y[i] = xi * (xi >= 0.0f ? d : e * d);
    }
  }
}

// SwiGLU with the same σ: one exp an element, each way.
KILN_CPU_CLONES void swiglu_f32(float* y, const float* g, const float* u, int64_t n) {
  KILN_SVE_SEAM(swiglu_f32, y, g, u, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i], e = fast_expf(-std::fabs(gi)), d = 1.0f / (1.0f + e);
    y[i] = gi * (gi >= 0.0f ? d : e * d) * u[i];
  }
}

KILN_CPU_CLONES void swiglu_grad_f32(float* dg, float* du, const float* dy, const float* g, const float* u,
                                     int64_t n) {
  KILN_SVE_SEAM(swiglu_grad_f32, dg, du, dy, g, u, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i], e = fast_expf(-std::fabs(gi)), d = 1.0f / (1.0f + e);
    const float sg = gi >= 0.0f ? d : e * d, om = gi >= 0.0f ? e * d : d;
    du[i] = dy[i] * (gi * sg);
    dg[i] = dy[i] * u[i] * (sg * (1.0f + gi * om));
  }
}

KILN_CPU_CLONES void rotary_row_f32(float* y, const float* x, const float* cos, const float* sin, int64_t half,
                                    bool transpose) {
  // The two halves in loops of their own (no per-element branch: they vectorise).
  const double sign = transpose ? 1.0 : -1.0;          // the first half's partner term
  const float* s_lo = transpose ? sin + half : sin;    // sin of the first half's partner
  const float* s_hi = transpose ? sin : sin + half;    // ... and of the second half's
#pragma omp simd
  for (int64_t c = 0; c < half; ++c)
    y[c] = static_cast<float>(double(x[c]) * cos[c] + sign * double(x[c + half]) * s_lo[c]);
#pragma omp simd
  for (int64_t c = half; c < 2 * half; ++c)
    y[c] = static_cast<float>(double(x[c]) * cos[c] - sign * double(x[c - half]) * s_hi[c - half]);
}

namespace {
constexpr int kLanes = 8;  // the lanes of a row's double sums (element c in lane c mod 8)

// Σ_c a[c]·b[c]·e[c] (e null: Σ a·b) in double over kLanes lanes, the lanes added in order.
inline double lane_dot(const float* a, const float* b, const float* e, int64_t n) {
  double acc[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j)
      acc[j] += double(a[c + j]) * double(b[c + j]) * (e ? double(e[c + j]) : 1.0);
  }
  for (int j = 0; c < n; ++c, ++j) acc[j] += double(a[c]) * double(b[c]) * (e ? double(e[c]) : 1.0);
  double s = 0;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}
}  // namespace

KILN_CPU_CLONES void rms_norm_rows_f32(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t d,
                                       double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const double rs = 1.0 / std::sqrt(lane_dot(xr, xr, nullptr, d) / static_cast<double>(d) + eps);
    rstd[r] = static_cast<float>(rs);
    float* yr = y + r * d;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) yr[c] = static_cast<float>(double(xr[c]) * rs * double(w[c]));
  }
}

KILN_CPU_CLONES void rms_norm_backward_rows_f32(float* dx, double* part, const float* dy, const float* x,
                                                const float* w, const float* rstd, int64_t r0, int64_t r1, int64_t d) {
  for (int64_t r = r0; r < r1; ++r) {
    const float *xr = x + r * d, *gr = dy + r * d;
    const double rs = static_cast<double>(rstd[r]);
    const double k = lane_dot(gr, w, xr, d) * rs * rs * rs / static_cast<double>(d);  // Σ dy·w·x
    float* dxr = dx + r * d;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c)
      dxr[c] = static_cast<float>(double(gr[c]) * double(w[c]) * rs - double(xr[c]) * k);
    if (part) {
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) part[c] += double(gr[c]) * double(xr[c]) * rs;
    }
  }
}

KILN_CPU_CLONES CeRowSums ce_row_sums_f32(const float* x, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;  // NaN compares false: skipped
  double se[kLanes] = {}, sx[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      se[j] += static_cast<double>(fast_expf(x[i + j] - m));
      sx[j] += static_cast<double>(x[i + j]);
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    se[j] += static_cast<double>(fast_expf(x[i] - m));
    sx[j] += static_cast<double>(x[i]);
  }
  CeRowSums r{m, 0.0, 0.0};
  for (int j = 0; j < kLanes; ++j) r.sum_exp += se[j], r.sum_x += sx[j];
  return r;
}

KILN_CPU_CLONES void ce_grad_row_f32(float* dx, const float* x, int64_t n, float lse, int64_t target, float hit,
                                     float off, float s) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dx[i] = s * (fast_expf(x[i] - lse) - off);
  if (target >= 0 && target < n) dx[target] = s * (fast_expf(x[target] - lse) - hit - off);
}

}  // namespace kiln::kernels::cpu
