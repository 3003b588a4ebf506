// References for FlexAttention (tests and benchmarks, not the training path):
// - reference_flex_attention: dense float64 attention applying the mods element by element, with
//   an analytic float64 backward (q, k, v, lse and the learnable bias table).
// - dense_attention_ops: the "reference path" built from kiln ops (matmul + mask + softmax +
//   matmul, autograd by the engine) — what the fused kernels are benchmarked against.
#pragma once
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

#include "kiln/attention/mods.h"
#include "kiln/ops/ops.h"

namespace kiln::attention {

struct ReferenceResult {
  Tensor out, lse;                // f64 [B, Hq, L, Ev], [B, Hq, L] (−inf on fully masked rows)
  Tensor dq, dk, dv, dbias;       // f64; defined when dout was given (dbias: learnable mods)
};

// q/k/v any floating dtype, any layout. dout [B, Hq, L, Ev] and dlse [B, Hq, L] optional.
// For a LearnableScoreMod, `bias` is its table [Hq, L+S-1] (the functor is bound here).
template <ScoreMod SM, MaskMod MM>
ReferenceResult reference_flex_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, SM sm, MM mm,
                                         double scale, const Tensor& dout_in = Tensor(),
                                         const Tensor& dlse_in = Tensor(), const Tensor& bias = Tensor()) {
  const int64_t B = q_in.size(0), Hq = q_in.size(1), L = q_in.size(2), E = q_in.size(3);
  const int64_t Hkv = k_in.size(1), S = k_in.size(2), Ev = v_in.size(3), G = Hq / Hkv;
  const auto q = q_in.to(DType::f64).to_vector<double>(), k = k_in.to(DType::f64).to_vector<double>(),
             v = v_in.to(DType::f64).to_vector<double>();
  std::vector<float> bias_host;
  if constexpr (is_learnable_v<SM>) {
    bias_host = bias.to(kCPU).to(DType::f32).to_vector<float>();
    sm.bias = bias_host.data();
    sm.row = L + S - 1;
    sm.offset = L - 1;
  }
  const bool grad = dout_in.defined();
  std::vector<double> dout, dlse;
  if (grad) dout = dout_in.to(DType::f64).to_vector<double>();
  if (dlse_in.defined()) dlse = dlse_in.to(DType::f64).to_vector<double>();
  const double ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> out(static_cast<size_t>(B * Hq * L * Ev), 0.0), lse(static_cast<size_t>(B * Hq * L), ninf);
  std::vector<double> dq(grad ? q.size() : 0, 0.0), dk(grad ? k.size() : 0, 0.0), dv(grad ? v.size() : 0, 0.0);
  std::vector<double> dbias(is_learnable_v<SM> && grad ? static_cast<size_t>(Hq * (L + S - 1)) : 0, 0.0);
  std::vector<double> raw(static_cast<size_t>(S)), x(static_cast<size_t>(S)), pr(static_cast<size_t>(S));
  std::vector<char> keep(static_cast<size_t>(S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < L; ++i) {
        const double* qi = &q[static_cast<size_t>(((b * Hq + h) * L + i) * E)];
        double mx = ninf;
        for (int64_t j = 0; j < S; ++j) {
          const double* kj = &k[static_cast<size_t>(((b * Hkv + hk) * S + j) * E)];
          double d = 0;
          for (int64_t e = 0; e < E; ++e) d += qi[e] * kj[e];
          raw[j] = scale * d;
          keep[j] = mm(int(b), int(h), int(i), int(j));
          x[j] = keep[j] ? static_cast<double>(sm(raw[j], int(b), int(h), int(i), int(j))) : ninf;
          mx = std::isnan(x[j]) ? x[j] : std::max(mx, x[j]);  // NaN kept: the row's output and lse are NaN
        }
        const size_t row = static_cast<size_t>((b * Hq + h) * L + i);
        if (mx == ninf) continue;  // fully masked: out 0, lse −inf, gradients 0
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) sum += (pr[j] = keep[j] ? std::exp(x[j] - mx) : 0.0);
        lse[row] = mx + std::log(sum);
        double* oi = &out[row * static_cast<size_t>(Ev)];
        for (int64_t j = 0; j < S; ++j) {
          pr[j] /= sum;
          const double* vj = &v[static_cast<size_t>(((b * Hkv + hk) * S + j) * Ev)];
          for (int64_t e = 0; e < Ev; ++e) oi[e] += pr[j] * vj[e];
        }
        if (!grad) continue;
        const double* gi = &dout[row * static_cast<size_t>(Ev)];
        double delta = 0;
        for (int64_t e = 0; e < Ev; ++e) delta += gi[e] * oi[e];
        if (!dlse.empty()) delta -= dlse[row];
        double* dqi = &dq[static_cast<size_t>(((b * Hq + h) * L + i) * E)];
        for (int64_t j = 0; j < S; ++j) {
          if (!keep[j]) continue;
          const size_t kvo = static_cast<size_t>((b * Hkv + hk) * S + j);
          const double* vj = &v[kvo * static_cast<size_t>(Ev)];
          double dp = 0;
          for (int64_t e = 0; e < Ev; ++e) {
            dp += gi[e] * vj[e];
            dv[kvo * static_cast<size_t>(Ev) + static_cast<size_t>(e)] += pr[j] * gi[e];
          }
          const double dx = pr[j] * (dp - delta);
          if constexpr (is_learnable_v<SM>) dbias[static_cast<size_t>(sm.bias_index(int(b), int(h), int(i), int(j)))] += dx;
          const double ds = dx * static_cast<double>(sm.dscore(raw[j], int(b), int(h), int(i), int(j))) * scale;
          const double* kj = &k[kvo * static_cast<size_t>(E)];
          for (int64_t e = 0; e < E; ++e) {
            dqi[e] += ds * kj[e];
            dk[kvo * static_cast<size_t>(E) + static_cast<size_t>(e)] += ds * qi[e];
          }
        }
      }
    }
  ReferenceResult r;
  r.out = from_vector(out, {B, Hq, L, Ev});
  r.lse = from_vector(lse, {B, Hq, L});
  if (grad) {
    r.dq = from_vector(dq, {B, Hq, L, E});
    r.dk = from_vector(dk, {B, Hkv, S, E});
    r.dv = from_vector(dv, {B, Hkv, S, Ev});
    if constexpr (is_learnable_v<SM>) r.dbias = from_vector(dbias, {Hq, L + S - 1});
  }
  return r;
}

// Dense attention from kiln ops with autograd: softmax(mask(scale · q kᵀ)) v, `drop` a bool
// [L, S] (true where the pair is masked out) or undefined; q [B, H, L, E], k/v [B, H, S, E] (no GQA). Fully masked rows
// give NaN-free zeros only if the caller avoids them (softmax of all −inf): benchmark use.
inline Tensor dense_attention_ops(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& drop,
                                  double scale) {
  Tensor s = mul(matmul(q, k.transpose(2, 3)), scale);
  if (drop.defined()) s = masked_fill(s, drop, -INFINITY);
  return matmul(softmax(s, -1), v);
}

}  // namespace kiln::attention
