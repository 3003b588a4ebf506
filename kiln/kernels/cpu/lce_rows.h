// The loops of the fused loss's CPU row pass (kernels/cpu/lce.cpp), one logit row z[0..v) at a
// time: bias and soft cap with the row's max, the label-smoothing sum, exp(z − max) and its sum,
// and d(loss)/dz written over the row. Each entry (A = float or double) starts, for f32 rows
// without soft cap, with the SVE seam (kernels/cpu/isa/isa.h; nothing on x86); the *_portable
// loops are the bodies every other case runs, kept callable so tests/isa can compare both sets
// in one process. Each row is reduced in index order by the portable loops and in svcntw() lanes
// summed by svaddv by the SVE ones: a fixed order for one vector length either way.
#pragma once
#include <cstdint>

#include "kiln/kernels/lce.h"

namespace kiln::kernels::cpu::lce_rows {

// z[j] = cap(z[j] + bias[j]) (bias may be null; cap 0: no soft cap); returns max_j z[j], NaN
// skipped (-inf for v == 0).
float logits_max(float* z, const float* bias, int64_t v, float cap);
double logits_max(double* z, const double* bias, int64_t v, double cap);
// Σ_j w[j]·z[j], or Σ_j z[j] when w is null.
float weighted_sum(const float* w, const float* z, int64_t v);
double weighted_sum(const double* w, const double* z, int64_t v);
// Σ_j exp(z[j] − mx); keep: z[j] = exp(z[j] − mx) as well.
float exp_sum(float* z, int64_t v, float mx, bool keep);
double exp_sum(double* z, int64_t v, double mx, bool keep);

// One row's gradient: z[j] = dz_j · cap'(z_j) · scale (LceRowTerms::dz, class weights w or 1).
// keep_exp: z holds exp(z − max) (exp_sum with keep, only without soft cap) and p_j = z[j]·inv_sum;
// else z holds the capped logits and p_j = exp(z[j] − lse). target in [0, v).
template <class A>
struct GradRow {
  LceRowTerms<A> terms;
  const A* w = nullptr;  // class weights or null
  int64_t target = 0;
  A inv_sum = 0, lse = 0, cap = 0, filter = 0, scale = 1;
  bool keep_exp = false;
};
void grad_row(float* z, int64_t v, const GradRow<float>& g);
void grad_row(double* z, int64_t v, const GradRow<double>& g);

// The portable bodies (what the entries run on x86, on NEON-only cores and for f64 / soft cap).
template <class A>
A logits_max_portable(A* z, const A* bias, int64_t v, A cap);
template <class A>
A weighted_sum_portable(const A* w, const A* z, int64_t v);
template <class A>
A exp_sum_portable(A* z, int64_t v, A mx, bool keep);
template <class A>
void grad_row_portable(A* z, int64_t v, const GradRow<A>& g);

}  // namespace kiln::kernels::cpu::lce_rows
