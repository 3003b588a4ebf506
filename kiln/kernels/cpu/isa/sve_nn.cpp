// SVE versions of the f32 RMSNorm rows (kernels/cpu/nn.cpp; statistics and outputs in double,
// as the portable loops, with per-lane partial sums), the AdamW update (kernels/optim.h's
// adamw_update, lane by lane) and the contiguous f32 <-> bf16 casts (core/half.h's BFloat16:
// round to nearest even in integer arithmetic, NaN kept and made quiet; no +bf16 instructions,
// whose NaN and denormal rules are not BFloat16's). Compiled only for aarch64 with
// -march=armv8-a+sve.
#include "kiln/kernels/cpu/isa/sve_common.h"

#if defined(__ARM_FEATURE_SVE)
#include <cmath>

#include "kiln/kernels/optim.h"

namespace kiln::kernels::cpu::isa::sve_impl {
namespace {

// f32 values at p[0..) widened into the double lanes of pg (one f32 per 64-bit container).
inline svfloat64_t load_f32_as_f64(svbool_t pg, const float* p) {
  const svuint64_t bits = svld1uw_u64(pg, reinterpret_cast<const uint32_t*>(p));
  return svcvt_f64_f32_x(pg, svreinterpret_f32_u64(bits));
}
// Rounds the double lanes of pg to f32 (to nearest even) and stores them contiguously.
inline void store_f64_as_f32(svbool_t pg, float* p, svfloat64_t v) {
  const svfloat32_t f = svcvt_f32_f64_x(pg, v);
  svst1w_u64(pg, reinterpret_cast<uint32_t*>(p), svreinterpret_u64_f32(f));
}

}  // namespace

void rms_norm_rows_f32(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t d, double eps) {
  const int64_t vd = static_cast<int64_t>(svcntd());
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    svfloat64_t ss = svdup_n_f64(0.0);
    for (int64_t c = 0; c < d; c += vd) {
      const svbool_t pg = svwhilelt_b64_s64(c, d);
      const svfloat64_t xc = load_f32_as_f64(pg, xr + c);
      ss = svmla_f64_m(pg, ss, xc, xc);
    }
    const double rs = 1.0 / std::sqrt(svaddv_f64(svptrue_b64(), ss) / static_cast<double>(d) + eps);
    rstd[r] = static_cast<float>(rs);
    float* yr = y + r * d;
    for (int64_t c = 0; c < d; c += vd) {
      const svbool_t pg = svwhilelt_b64_s64(c, d);
      const svfloat64_t v = svmul_f64_x(pg, svmul_n_f64_x(pg, load_f32_as_f64(pg, xr + c), rs), load_f32_as_f64(pg, w + c));
      store_f64_as_f32(pg, yr + c, v);
    }
  }
}

void rms_norm_backward_rows_f32(float* dx, double* part, const float* dy, const float* x, const float* w,
                                const float* rstd, int64_t r0, int64_t r1, int64_t d) {
  const int64_t vd = static_cast<int64_t>(svcntd());
  for (int64_t r = r0; r < r1; ++r) {
    const float *xr = x + r * d, *gr = dy + r * d;
    const double rs = static_cast<double>(rstd[r]);
    svfloat64_t dot = svdup_n_f64(0.0);  // sum_c dy*w*x
    for (int64_t c = 0; c < d; c += vd) {
      const svbool_t pg = svwhilelt_b64_s64(c, d);
      const svfloat64_t gw = svmul_f64_x(pg, load_f32_as_f64(pg, gr + c), load_f32_as_f64(pg, w + c));
      dot = svmla_f64_m(pg, dot, gw, load_f32_as_f64(pg, xr + c));
    }
    const double k = svaddv_f64(svptrue_b64(), dot) * rs * rs * rs / static_cast<double>(d);
    float* dxr = dx + r * d;
    for (int64_t c = 0; c < d; c += vd) {
      const svbool_t pg = svwhilelt_b64_s64(c, d);
      const svfloat64_t xc = load_f32_as_f64(pg, xr + c), gc = load_f32_as_f64(pg, gr + c);
      const svfloat64_t gwr = svmul_n_f64_x(pg, svmul_f64_x(pg, gc, load_f32_as_f64(pg, w + c)), rs);
      store_f64_as_f32(pg, dxr + c, svmls_n_f64_x(pg, gwr, xc, k));  // g·w·rs − x·k
      if (part) {
        const svfloat64_t pc = svld1_f64(pg, part + c);
        svst1_f64(pg, part + c, svmla_f64_x(pg, pc, svmul_f64_x(pg, gc, xc), svdup_n_f64(rs)));
      }
    }
  }
}

namespace {

// kernels/optim.h's adamw_update on the lanes of pg.
inline void adamw_lanes(svbool_t pg, float* p, float* m, float* v, svfloat32_t g, const AdamWStep& s) {
  svfloat32_t pv = svld1_f32(pg, p), mv = svld1_f32(pg, m), vv = svld1_f32(pg, v);
  pv = svmls_n_f32_x(pg, pv, pv, s.lr_wd);
  mv = svmla_n_f32_x(pg, svmul_n_f32_x(pg, mv, s.beta1), g, s.one_minus_beta1);
  vv = svmla_n_f32_x(pg, svmul_n_f32_x(pg, vv, s.beta2), svmul_f32_x(pg, g, g), s.one_minus_beta2);
  const svfloat32_t denom = svadd_n_f32_x(pg, svdiv_n_f32_x(pg, svsqrt_f32_x(pg, vv), s.bias_correction2_sqrt), s.eps);
  pv = svmls_n_f32_x(pg, pv, svdiv_f32_x(pg, mv, denom), s.step_size);
  svst1_f32(pg, p, pv), svst1_f32(pg, m, mv), svst1_f32(pg, v, vv);
}

inline svfloat32_t load_bf16(svbool_t pg, const uint16_t* src) {
  return svreinterpret_f32_u32(svlsl_n_u32_x(pg, svld1uh_u32(pg, src), 16));
}

// The gradient lanes times `scale` (one f32 multiply, rounded as clip_grad_norm_'s in-place
// g *= scale rounds it), or as loaded when scale is 1 (the unclipped step multiplies nothing).
template <class Load>
void adamw_loop(float* p, float* m, float* v, int64_t n, const AdamWStep& s, float scale, Load load) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  if (scale == 1.0f) {
    for (int64_t i = 0; i < n; i += vl) {
      const svbool_t pg = svwhilelt_b32_s64(i, n);
      adamw_lanes(pg, p + i, m + i, v + i, load(pg, i), s);
    }
    return;
  }
  for (int64_t i = 0; i < n; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    adamw_lanes(pg, p + i, m + i, v + i, svmul_n_f32_x(pg, load(pg, i), scale), s);
  }
}

}  // namespace

void adamw_f32(float* p, float* m, float* v, const float* g, int64_t n, const AdamWStep& s, float scale) {
  adamw_loop(p, m, v, n, s, scale, [g](svbool_t pg, int64_t i) { return svld1_f32(pg, g + i); });
}

void adamw_bf16(float* p, float* m, float* v, const uint16_t* g, int64_t n, const AdamWStep& s, float scale) {
  adamw_loop(p, m, v, n, s, scale, [g](svbool_t pg, int64_t i) { return load_bf16(pg, g + i); });
}

void f32_to_bf16(uint16_t* dst, const float* src, int64_t n) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  for (int64_t i = 0; i < n; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    const svuint32_t u = svld1_u32(pg, reinterpret_cast<const uint32_t*>(src + i));
    const svuint32_t lsb = svand_n_u32_x(pg, svlsr_n_u32_x(pg, u, 16), 1u);
    const svuint32_t rounded = svlsr_n_u32_x(pg, svadd_u32_x(pg, u, svadd_n_u32_x(pg, lsb, 0x7fffu)), 16);
    const svuint32_t quiet = svorr_n_u32_x(pg, svlsr_n_u32_x(pg, u, 16), 0x40u);
    const svbool_t nan = svcmpgt_n_u32(pg, svand_n_u32_x(pg, u, 0x7fffffffu), 0x7f800000u);
    svst1h_u32(pg, dst + i, svsel_u32(nan, quiet, rounded));
  }
}

void bf16_to_f32(float* dst, const uint16_t* src, int64_t n) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  for (int64_t i = 0; i < n; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    svst1_f32(pg, dst + i, load_bf16(pg, src + i));
  }
}

}  // namespace kiln::kernels::cpu::isa::sve_impl
#endif
