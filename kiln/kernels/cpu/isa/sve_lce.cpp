// SVE versions of the fused loss's f32 row loops without soft cap (kernels/cpu/lce_rows.h):
// bias and the row's max, the label-smoothing sum, exp(z − max) (sve_common.h's exp_f32, the
// vector fast_expf) with its sum, and the gradient row. Sums are per-lane partials in index order
// added up by svaddv: a fixed order for one vector length. Compiled only for aarch64 with
// -march=armv8-a+sve, chosen at run time by kernels/cpu/isa/isa.cpp.
#include "kiln/kernels/cpu/isa/sve_common.h"

#if defined(__ARM_FEATURE_SVE)
#include <limits>

namespace kiln::kernels::cpu::isa::sve_impl {

// z[j] += bias[j] (bias may be null); the max of z with NaN skipped, as the portable
// std::max(mx, x) (a lane takes x only when greater).
float lce_logits_max_f32(float* z, const float* bias, int64_t v) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  svfloat32_t mx = svdup_n_f32(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < v; j += vl) {
    const svbool_t pg = svwhilelt_b32_s64(j, v);
    svfloat32_t x = svld1_f32(pg, z + j);
    if (bias) {
      x = svadd_f32_x(pg, x, svld1_f32(pg, bias + j));
      svst1_f32(pg, z + j, x);
    }
    mx = svsel_f32(svcmpgt_f32(pg, x, mx), x, mx);
  }
  return svmaxv_f32(svptrue_b32(), mx);
}

float lce_weighted_sum_f32(const float* w, const float* z, int64_t v) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  svfloat32_t s = svdup_n_f32(0.0f);
  for (int64_t j = 0; j < v; j += vl) {
    const svbool_t pg = svwhilelt_b32_s64(j, v);
    const svfloat32_t x = svld1_f32(pg, z + j);
    s = w ? svmla_f32_m(pg, s, svld1_f32(pg, w + j), x) : svadd_f32_m(pg, s, x);
  }
  return svaddv_f32(svptrue_b32(), s);
}

float lce_exp_sum_f32(float* z, int64_t v, float mx, bool keep) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  svfloat32_t sum = svdup_n_f32(0.0f);
  for (int64_t j = 0; j < v; j += vl) {
    const svbool_t pg = svwhilelt_b32_s64(j, v);
    const svfloat32_t e = exp_f32(pg, svsub_n_f32_x(pg, svld1_f32(pg, z + j), mx));
    if (keep) svst1_f32(pg, z + j, e);
    sum = svadd_f32_m(pg, sum, e);
  }
  return svaddv_f32(svptrue_b32(), sum);
}

// dz_j = p_j·p_coef − w_j·smooth_coef (− target_coef at the target), |dz_j| < filter → 0 when
// filter > 0, times scale: LceRowTerms::dz lane by lane, the target's term under a one-lane
// predicate.
void lce_grad_row_f32(float* z, int64_t v, const LceGradRowF32& g) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  const svfloat32_t zero = svdup_n_f32(0.0f);
  const bool filter = g.filter > 0.0f;
  for (int64_t j = 0; j < v; j += vl) {
    const svbool_t pg = svwhilelt_b32_s64(j, v);
    const svfloat32_t p = svmul_n_f32_x(pg, svld1_f32(pg, z + j), g.inv_sum);
    const svfloat32_t smooth = g.w ? svmul_n_f32_x(pg, svld1_f32(pg, g.w + j), g.smooth_coef) : svdup_n_f32(g.smooth_coef);
    svfloat32_t d = svsub_f32_x(pg, svmul_n_f32_x(pg, p, g.p_coef), smooth);
    if (g.target >= j && g.target < j + vl) {
      const svbool_t at = svcmpeq_n_u32(pg, svindex_u32(0, 1), static_cast<uint32_t>(g.target - j));
      d = svsub_n_f32_m(at, d, g.target_coef);
    }
    if (filter) d = svsel_f32(svaclt_n_f32(pg, d, g.filter), zero, d);
    svst1_f32(pg, z + j, svmul_n_f32_x(pg, d, g.scale));
  }
}

}  // namespace kiln::kernels::cpu::isa::sve_impl
#endif
