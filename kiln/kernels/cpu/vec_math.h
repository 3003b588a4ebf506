// Vectorisable f32 math for CPU kernels: fast_expf (a branch-free polynomial exp) and the
// contiguous f32 SiLU and SwiGLU loops built on it (vec_math.cpp, compiled for x86-64-v4 (AVX-512),
// x86-64-v3 (AVX2 + FMA) and the baseline and picked at load time by CPU features: KILN_CPU_CLONES).
#pragma once
#include <bit>
#include <cstdint>

namespace kiln::kernels::cpu {

// "arch=x86-64-v4" / "arch=x86-64-v3" dispatch on the CPU's features (AVX-512 F/BW/CD/DQ/VL;
// AVX2, FMA, ...); "arch=haswell" would dispatch on the CPU model (Intel Haswell only) and leave
// every other x86 on the baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define KILN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KILN_CPU_CLONES
#endif

// exp(x) for x <= ~88 with ~2 ulp error; exactly 0 for x < -87.3 (and for -inf). Branch-free
// (a multiplier instead of a select), so loops over it vectorise where FP traps are off
// (files using it in hot loops are compiled with no-trapping-math). NaN in gives NaN out (the
// clamps below would make it exp(88); a select at the end keeps it).
inline float fast_expf(float x) {
  const float in = x;
  const float keep = x < -87.3f ? 0.0f : 1.0f;
  x = x < 88.0f ? x : 88.0f;
  x = x > -87.3f ? x : -87.3f;
  float t = x * 1.44269504088896341f;
  float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float s = std::bit_cast<float>(e);
  const float y = p * s * keep;
  return in == in ? y : in;
}

// y[i] = silu(x[i]) = x·σ(x), or (deriv) σ(x)·(1 + x·(1 − σ(x))), for i < n (f32, contiguous;
// the formulas of kernels/elementwise.h with σ from fast_expf(−|x|); NaN propagates through x;
// |results| below ~1e-37 (x < −87) flush to ±0).
void silu_f32(float* y, const float* x, int64_t n, bool deriv);
// SwiGLU (kernels/elementwise.h's swiglu_math and swiglu_grad_math with silu_f32's σ): y[i] =
// silu(g[i])·u[i]; dg[i] = dy[i]·u[i]·silu'(g[i]), du[i] = dy[i]·silu(g[i]).
void swiglu_f32(float* y, const float* g, const float* u, int64_t n);
void swiglu_grad_f32(float* dg, float* du, const float* dy, const float* g, const float* u, int64_t n);
// One f32 row of the rotary embedding (kernels/nn.h's rotary): y[c] = x[c]·cos[c] ∓ x[c ± half]·sin,
// each element one double sum of two products rounded to f32 (the products of floats are exact in
// double, so the bits do not depend on the vector width or on FMA); transpose applies the inverse
// rotation (the backward).
void rotary_row_f32(float* y, const float* x, const float* cos, const float* sin, int64_t half, bool transpose);

// RMSNorm on f32 rows (kernels/cpu/nn.cpp; the signatures of the SVE set's rms_norm_rows_f32 and
// rms_norm_backward_rows_f32, isa.h, which sum over the SVE vector's lanes instead): the row
// statistics in double over 8 lanes (element c in lane c mod 8, the lanes added in order), each
// element one double expression rounded to f32 once. part (d doubles, or null) accumulates
// dweight's partial sums over rows [r0, r1) in row order, in a pass after dx: dx must not alias
// dy or x. A fixed order, so the bits do not change run to run or with the thread count; like the
// other loops of this file, the x86-64-v3/v4 clones may fuse a product and a sum into one FMA
// (GCC's default contraction), so a CPU without FMA (the baseline clone) can differ in the last bit.
void rms_norm_rows_f32(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t d, double eps);
void rms_norm_backward_rows_f32(float* dx, double* part, const float* dy, const float* x, const float* w,
                                const float* rstd, int64_t r0, int64_t r1, int64_t d);

// One f32 row x[0..n) of cross-entropy (kernels/cpu/nn.cpp): its max m (NaN skipped; -inf for
// n == 0), Σ exp(x[i] − m) with fast_expf's f32 exps, and Σ x[i], both summed in double in 8 lanes
// (element i in lane i mod 8, the lanes added in order: fixed bits for one CPU, see RMSNorm above).
struct CeRowSums {
  float max;
  double sum_exp, sum_x;
};
CeRowSums ce_row_sums_f32(const float* x, int64_t n);
// The row's gradient: dx[i] = s · (exp(x[i] − lse) − (i == target ? hit : 0) − off), exp by fast_expf
// (target outside [0, n): no hit). The target's element is written again after the row: dx must
// not alias x.
void ce_grad_row_f32(float* dx, const float* x, int64_t n, float lse, int64_t target, float hit, float off, float s);

}  // namespace kiln::kernels::cpu
