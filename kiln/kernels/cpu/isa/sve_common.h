// Shared pieces of the SVE kernel files (kernels/cpu/isa/sve_*.cpp, compiled with
// -march=armv8-a+sve; included only there): the vector fast_expf and the declarations of the
// SVE kernels that sve_table.cpp collects. Vector-length agnostic: every loop steps by svcntw()
// (or svcntd()) and its last step runs under a svwhilelt predicate.
#pragma once
#if defined(__ARM_FEATURE_SVE)
#include <arm_sve.h>

#include <cstdint>

#include "kiln/kernels/cpu/isa/isa.h"

namespace kiln::kernels::cpu::isa::sve_impl {

// kernels/cpu/vec_math.h's fast_expf, lane by lane: the same clamps, the same Cody-Waite split
// (n rounded to nearest even, as the 1.5·2^23 trick does) and polynomial, fused multiply-adds;
// exactly 0 below −87.3 (and for −inf), NaN in gives that NaN out.
inline svfloat32_t exp_f32(svbool_t pg, svfloat32_t x) {
  const svfloat32_t in = x;
  const svbool_t under = svcmplt_n_f32(pg, x, -87.3f);
  x = svminnm_n_f32_x(pg, x, 88.0f);
  x = svmaxnm_n_f32_x(pg, x, -87.3f);
  const svfloat32_t n = svrintn_f32_x(pg, svmul_n_f32_x(pg, x, 1.44269504088896341f));
  svfloat32_t r = svmls_n_f32_x(pg, x, n, 0.693359375f);
  r = svmls_n_f32_x(pg, r, n, -2.12194440e-4f);
  svfloat32_t p = svdup_n_f32(1.9875691500e-4f);
  p = svmad_n_f32_x(pg, p, r, 1.3981999507e-3f);
  p = svmad_n_f32_x(pg, p, r, 8.3334519073e-3f);
  p = svmad_n_f32_x(pg, p, r, 4.1665795894e-2f);
  p = svmad_n_f32_x(pg, p, r, 1.6666665459e-1f);
  p = svmad_n_f32_x(pg, p, r, 5.0000001201e-1f);
  p = svmla_f32_x(pg, r, p, svmul_f32_x(pg, r, r));  // p·r² + r
  p = svadd_n_f32_x(pg, p, 1.0f);
  const svint32_t e = svlsl_n_s32_x(pg, svadd_n_s32_x(pg, svcvt_s32_f32_x(pg, n), 127), 23);
  svfloat32_t y = svmul_f32_x(pg, p, svreinterpret_f32_s32(e));
  y = svsel_f32(under, svdup_n_f32(0.0f), y);
  return svsel_f32(svcmpuo_f32(pg, in, in), in, y);
}

// σ(x) from e = exp(−|x|): d = 1 / (1 + e); σ = x ≥ 0 ? d : e·d and 1 − σ = x ≥ 0 ? e·d : d.
inline void sigmoid_f32(svbool_t pg, svfloat32_t x, svfloat32_t& sg, svfloat32_t& om) {
  const svfloat32_t e = exp_f32(pg, svneg_f32_x(pg, svabs_f32_x(pg, x)));
  const svfloat32_t d = svdiv_f32_x(pg, svdup_n_f32(1.0f), svadd_n_f32_x(pg, e, 1.0f));
  const svfloat32_t ed = svmul_f32_x(pg, e, d);
  const svbool_t pos = svcmpge_n_f32(pg, x, 0.0f);
  sg = svsel_f32(pos, d, ed);
  om = svsel_f32(pos, ed, d);
}

// sve_math.cpp
void silu_f32(float* y, const float* x, int64_t n, bool deriv);
void swiglu_f32(float* y, const float* g, const float* u, int64_t n);
void swiglu_grad_f32(float* dg, float* du, const float* dy, const float* g, const float* u, int64_t n);
float row_dot(const float* a, const float* b, int64_t n);
float row_max(const float* s, int64_t n);
float row_exp_sum(float* s, int64_t n, float m);
void row_softmax_grad(float* s, float* d, int64_t n, float lse, float delta);
// sve_tiles.cpp
void tile_abt(float* s, int64_t ld, const float* a, int64_t m, int64_t n, const float* bt, int64_t nk);
void tile_ax(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols);
void tile_atx(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols);
// sve_nn.cpp
void rms_norm_rows_f32(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t d, double eps);
void rms_norm_backward_rows_f32(float* dx, double* part, const float* dy, const float* x, const float* w,
                                const float* rstd, int64_t r0, int64_t r1, int64_t d);
void adamw_f32(float* p, float* m, float* v, const float* g, int64_t n, const AdamWStep& s, float scale);
void adamw_bf16(float* p, float* m, float* v, const uint16_t* g, int64_t n, const AdamWStep& s, float scale);
void f32_to_bf16(uint16_t* dst, const float* src, int64_t n);
void bf16_to_f32(float* dst, const uint16_t* src, int64_t n);
// sve_lce.cpp
float lce_logits_max_f32(float* z, const float* bias, int64_t v);
float lce_weighted_sum_f32(const float* w, const float* z, int64_t v);
float lce_exp_sum_f32(float* z, int64_t v, float mx, bool keep);
void lce_grad_row_f32(float* z, int64_t v, const LceGradRowF32& g);

}  // namespace kiln::kernels::cpu::isa::sve_impl
#endif
