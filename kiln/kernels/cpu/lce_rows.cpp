// The fused loss's CPU row loops (kernels/cpu/lce_rows.h): portable bodies for f32 and f64, and
// the entries that forward f32 rows without soft cap to the SVE set where it is in use.
#include "kiln/kernels/cpu/lce_rows.h"

#include <algorithm>
#include <cmath>

#include "kiln/kernels/cpu/isa/isa.h"  // KILN_SVE_SEAM: the SVE set on aarch64, nothing on x86

namespace kiln::kernels::cpu::lce_rows {

template <class A>
A logits_max_portable(A* z, const A* bias, int64_t v, A cap) {
  A mx = -INFINITY;
  for (int64_t j = 0; j < v; ++j) {
    A x = bias ? z[j] + bias[j] : z[j];
    x = lce_cap(x, cap);
    z[j] = x;
    mx = std::max(mx, x);
  }
  return mx;
}

template <class A>
A weighted_sum_portable(const A* w, const A* z, int64_t v) {
  A s = 0;
  for (int64_t j = 0; j < v; ++j) s += (w ? w[j] : A(1)) * z[j];
  return s;
}

template <class A>
A exp_sum_portable(A* z, int64_t v, A mx, bool keep) {
  A sum = 0;
  if (keep) {
    for (int64_t j = 0; j < v; ++j) {
      const A e = std::exp(z[j] - mx);
      z[j] = e;
      sum += e;
    }
  } else {
    for (int64_t j = 0; j < v; ++j) sum += std::exp(z[j] - mx);
  }
  return sum;
}

template <class A>
void grad_row_portable(A* z, int64_t v, const GradRow<A>& g) {
  for (int64_t j = 0; j < v; ++j) {
    const A pj = g.keep_exp ? z[j] * g.inv_sum : std::exp(z[j] - g.lse);
    const A dz = g.terms.dz(pj, g.w ? g.w[j] : A(1), j == g.target, g.filter);
    z[j] = dz * (g.keep_exp ? A(1) : lce_cap_deriv(z[j], g.cap)) * g.scale;
  }
}

template float logits_max_portable<float>(float*, const float*, int64_t, float);
template double logits_max_portable<double>(double*, const double*, int64_t, double);
template float weighted_sum_portable<float>(const float*, const float*, int64_t);
template double weighted_sum_portable<double>(const double*, const double*, int64_t);
template float exp_sum_portable<float>(float*, int64_t, float, bool);
template double exp_sum_portable<double>(double*, int64_t, double, bool);
template void grad_row_portable<float>(float*, int64_t, const GradRow<float>&);
template void grad_row_portable<double>(double*, int64_t, const GradRow<double>&);

float logits_max(float* z, const float* bias, int64_t v, float cap) {
  if (cap == 0.0f) KILN_SVE_SEAM(lce_logits_max_f32, z, bias, v);
  return logits_max_portable(z, bias, v, cap);
}
double logits_max(double* z, const double* bias, int64_t v, double cap) {
  return logits_max_portable(z, bias, v, cap);
}

float weighted_sum(const float* w, const float* z, int64_t v) {
  KILN_SVE_SEAM(lce_weighted_sum_f32, w, z, v);
  return weighted_sum_portable(w, z, v);
}
double weighted_sum(const double* w, const double* z, int64_t v) { return weighted_sum_portable(w, z, v); }

float exp_sum(float* z, int64_t v, float mx, bool keep) {
  KILN_SVE_SEAM(lce_exp_sum_f32, z, v, mx, keep);
  return exp_sum_portable(z, v, mx, keep);
}
double exp_sum(double* z, int64_t v, double mx, bool keep) { return exp_sum_portable(z, v, mx, keep); }

void grad_row(float* z, int64_t v, const GradRow<float>& g) {
#if KILN_ISA_SEAMS
  if (g.keep_exp) {
    const isa::LceGradRowF32 s{g.w,          g.target, g.inv_sum, g.terms.p_coef, g.terms.target_coef,
                               g.terms.smooth_coef, g.filter, g.scale};
    KILN_SVE_SEAM(lce_grad_row_f32, z, v, s);
  }
#endif
  grad_row_portable(z, v, g);
}
void grad_row(double* z, int64_t v, const GradRow<double>& g) { grad_row_portable(z, v, g); }

}  // namespace kiln::kernels::cpu::lce_rows
