// SVE versions of the f32 vector math (kernels/cpu/vec_math.h: SiLU, SwiGLU) and of the flex
// attention's row loops (kernels/cpu/attention_impl.h: row_dot, row_max, row_exp_sum,
// row_softmax_grad). Vector-length agnostic with predicated tails; compiled only for aarch64,
// with -march=armv8-a+sve (CMakeLists.txt), chosen at run time by kernels/cpu/isa/isa.cpp.
#include "kiln/kernels/cpu/isa/sve_common.h"

#if defined(__ARM_FEATURE_SVE)
#include <cmath>
#include <limits>

namespace kiln::kernels::cpu::isa::sve_impl {

void silu_f32(float* y, const float* x, int64_t n, bool deriv) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  for (int64_t i = 0; i < n; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    const svfloat32_t xi = svld1_f32(pg, x + i);
    svfloat32_t sg, om;
    sigmoid_f32(pg, xi, sg, om);
    const svfloat32_t r = deriv ? svmul_f32_x(pg, sg, svmla_f32_x(pg, svdup_n_f32(1.0f), xi, om))
                                : svmul_f32_x(pg, xi, sg);
    svst1_f32(pg, y + i, r);
  }
}

void swiglu_f32(float* y, const float* g, const float* u, int64_t n) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  for (int64_t i = 0; i < n; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    const svfloat32_t gi = svld1_f32(pg, g + i);
    svfloat32_t sg, om;
    sigmoid_f32(pg, gi, sg, om);
    svst1_f32(pg, y + i, svmul_f32_x(pg, svmul_f32_x(pg, gi, sg), svld1_f32(pg, u + i)));
  }
}

void swiglu_grad_f32(float* dg, float* du, const float* dy, const float* g, const float* u, int64_t n) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  for (int64_t i = 0; i < n; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    const svfloat32_t gi = svld1_f32(pg, g + i), di = svld1_f32(pg, dy + i);
    svfloat32_t sg, om;
    sigmoid_f32(pg, gi, sg, om);
    svst1_f32(pg, du + i, svmul_f32_x(pg, di, svmul_f32_x(pg, gi, sg)));
    const svfloat32_t dsilu = svmul_f32_x(pg, sg, svmla_f32_x(pg, svdup_n_f32(1.0f), gi, om));
    svst1_f32(pg, dg + i, svmul_f32_x(pg, svmul_f32_x(pg, di, svld1_f32(pg, u + i)), dsilu));
  }
}

// One fused multiply-add per term in increasing e: the order and rounding of one element of
// the SVE tile_abt (svmla in e order), so that Δ = rowsum(dO ∘ O) cancels exactly against dP
// where P is one-hot, as the portable pair does without FMA.
float row_dot(const float* a, const float* b, int64_t n) {
  float d = 0.0f;
  for (int64_t e = 0; e < n; ++e) d = std::fma(a[e], b[e], d);
  return d;
}

// NaN is skipped, as the portable loop's `s > mx ? s : mx` (a lane takes s only when greater).
float row_max(const float* s, int64_t n) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  svfloat32_t mx = svdup_n_f32(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += vl) {
    const svbool_t pg = svwhilelt_b32_s64(j, n);
    const svfloat32_t v = svld1_f32(pg, s + j);
    mx = svsel_f32(svcmpgt_f32(pg, v, mx), v, mx);
  }
  return svmaxv_f32(svptrue_b32(), mx);
}

// Per-lane partial sums added up by svaddv at the end: a fixed order for a given vector length.
float row_exp_sum(float* s, int64_t n, float m) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  svfloat32_t sum = svdup_n_f32(0.0f);
  for (int64_t j = 0; j < n; j += vl) {
    const svbool_t pg = svwhilelt_b32_s64(j, n);
    const svfloat32_t e = exp_f32(pg, svsub_n_f32_x(pg, svld1_f32(pg, s + j), m));
    svst1_f32(pg, s + j, e);
    sum = svadd_f32_m(pg, sum, e);
  }
  return svaddv_f32(svptrue_b32(), sum);
}

void row_softmax_grad(float* s, float* d, int64_t n, float lse, float delta) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  for (int64_t j = 0; j < n; j += vl) {
    const svbool_t pg = svwhilelt_b32_s64(j, n);
    const svfloat32_t p = exp_f32(pg, svsub_n_f32_x(pg, svld1_f32(pg, s + j), lse));
    svst1_f32(pg, s + j, p);
    svst1_f32(pg, d + j, svmul_f32_x(pg, p, svsub_n_f32_x(pg, svld1_f32(pg, d + j), delta)));
  }
}

}  // namespace kiln::kernels::cpu::isa::sve_impl
#endif
