// The CPU kernel sets (kernels/cpu/isa/isa.h): the kernel set in use is the one the CI run
// expects (KILN_EXPECT_SVE_BITS: 128 or 256 under qemu's sve128 / sve256, 0 for NEON only) and its
// dispatch counter moves; the entries in use (x86 clones, NEON, or SVE through the seams) and the
// SVE table itself (where the core has SVE) agree with float64 references at odd lengths
// (1, 3, 17, 129, 1000: every predicated tail at 128 and 256 bits), NaN and inf as the portable
// formulas give them, and the casts are BFloat16's bits exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kiln/core/half.h"
#include "kiln/kernels/cpu/attention_impl.h"
#include "kiln/kernels/cpu/isa/isa.h"
#include "kiln/kernels/cpu/vec_math.h"
#include "kiln/kernels/optim.h"
#include "tests/expect.h"

using namespace kiln;
using kiln::test::all_close;
namespace cpu = kiln::kernels::cpu;
namespace isa = kiln::kernels::cpu::isa;

namespace {

constexpr int64_t kLengths[] = {1, 3, 17, 129, 1000};

struct Set {
  std::string name;
  void (*silu)(float*, const float*, int64_t, bool);
  void (*swiglu)(float*, const float*, const float*, int64_t);
  void (*swiglu_grad)(float*, float*, const float*, const float*, const float*, int64_t);
  float (*row_max)(const float*, int64_t);
  float (*row_exp_sum)(float*, int64_t, float);
  void (*tile_abt)(float*, int64_t, const float*, int64_t, int64_t, const float*, int64_t);
  void (*tile_ax)(float*, int64_t, const float*, int64_t, int64_t, const float*, int64_t);
  void (*tile_atx)(float*, int64_t, const float*, int64_t, int64_t, const float*, int64_t);
  float (*row_dot)(const float*, const float*, int64_t);
  void (*row_softmax_grad)(float*, float*, int64_t, float, float);
};

std::vector<Set> sets() {
  std::vector<Set> v{{"in use (" + isa::cpu_features().kernels + ")", cpu::silu_f32, cpu::swiglu_f32,
                      cpu::swiglu_grad_f32, cpu::flex_detail::row_max, cpu::flex_detail::row_exp_sum,
                      cpu::flex_detail::tile_abt, cpu::flex_detail::tile_ax, cpu::flex_detail::tile_atx,
                      cpu::flex_detail::row_dot, cpu::flex_detail::row_softmax_grad}};
  if (const auto* k = isa::sve_available())
    v.push_back({"sve table", k->silu_f32, k->swiglu_f32, k->swiglu_grad_f32, k->row_max, k->row_exp_sum, k->tile_abt,
                 k->tile_ax, k->tile_atx, k->row_dot, k->row_softmax_grad});
  return v;
}

std::vector<float> inputs(int64_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, 8.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& e : x) e = d(g);
  const float edges[] = {0.0f, -0.0f, 100.0f, -100.0f, 88.5f, -88.5f, 1e-30f};
  for (size_t i = 0; i < std::size(edges) && i < x.size(); ++i) x[i] = edges[i];
  return x;
}

// σ as the kernels form it (exp(−|x|), so ±inf give 0 and 1), in double.
double sigmoid(double x) {
  const double e = std::exp(-std::fabs(x));
  return x >= 0 ? 1 / (1 + e) : e / (1 + e);
}

uint64_t seed() { return std::random_device{}(); }

}  // namespace

TEST(Isa, KernelSetIsTheExpectedOne) {
  const isa::CpuFeatures& f = isa::cpu_features();
  const char* want = std::getenv("KILN_EXPECT_SVE_BITS");
  std::vector<float> x{1.0f, -2.0f, 3.0f}, y(3);
  const uint64_t before = isa::sve_calls();
  cpu::silu_f32(y.data(), x.data(), 3, false);
  const uint64_t calls = isa::sve_calls() - before;
  if (want) {
    const int bits = std::atoi(want);
    EXPECT_EQ(f.arch, "aarch64");
    EXPECT_EQ(f.sve_bits, bits) << "the SVE length the kernel reports";
    if (bits > 0) {
      EXPECT_EQ(f.kernels, "sve");
      EXPECT_EQ(f.vector_bits, bits);
      ASSERT_NE(isa::sve(), nullptr);
      EXPECT_EQ(isa::sve()->vector_bits(), bits);
      EXPECT_EQ(calls, 1u) << "silu_f32 did not take the SVE path";
    } else {
      EXPECT_EQ(f.kernels, "neon");
      EXPECT_EQ(isa::sve(), nullptr);
      EXPECT_EQ(calls, 0u);
    }
  } else {
    EXPECT_EQ(calls, isa::sve() ? 1u : 0u);
    if (f.kernels == "sve") EXPECT_EQ(f.vector_bits, f.sve_bits);
  }
}

TEST(Isa, SiluAndSwigluMatchFloat64AtOddLengths) {
  for (const Set& s : sets())
    for (int64_t n : kLengths) {
      const uint64_t sd = seed();
      SCOPED_TRACE(s.name + " n=" + std::to_string(n) + " seed " + std::to_string(sd));
      std::vector<float> x = inputs(n, sd), u = inputs(n, sd + 1), dy = inputs(n, sd + 2);
      if (n >= 17) x[7] = std::nanf(""), x[8] = INFINITY, x[9] = -INFINITY;
      std::vector<float> y(x.size(), 7.0f), g(x.size()), sw(x.size()), dg(x.size()), du(x.size());
      s.silu(y.data(), x.data(), n, false);
      s.silu(g.data(), x.data(), n, true);
      s.swiglu(sw.data(), x.data(), u.data(), n);
      s.swiglu_grad(dg.data(), du.data(), dy.data(), x.data(), u.data(), n);
      for (size_t i = 0; i < x.size(); ++i) {
        const double xi = x[i], sg = sigmoid(xi), silu = xi * sg, d = sg * (1 + xi * (1 - sg));
        const std::string at = " at x=" + std::to_string(xi);
        if (xi < -87.3) {  // exp(x) flushes to 0 there: every result is ±0 (or NaN at −inf)
          if (!std::isinf(xi)) EXPECT_EQ(y[i], 0.0f) << "silu" << at;
          continue;
        }
        // the tolerances of tests/ops (Unary.SiluF32FastPathMatchesFloat64); below 1e-35 results may flush to 0
        EXPECT_TRUE(all_close(y[i], silu, {4e-7 * std::fabs(silu) + 1e-35, 0}, "silu" + at));
        EXPECT_TRUE(all_close(g[i], d, {4e-7 * sg * (1 + std::fabs(xi)) + 1e-35, 0}, "silu'" + at));
        EXPECT_TRUE(all_close(sw[i], silu * u[i], {6e-7 * std::fabs(silu * u[i]) + 1e-35, 0}, "swiglu" + at));
        EXPECT_TRUE(all_close(du[i], dy[i] * silu, {6e-7 * std::fabs(dy[i] * silu) + 1e-35, 0}, "swiglu du" + at));
        EXPECT_TRUE(all_close(dg[i], dy[i] * u[i] * d,
                              {6e-7 * std::fabs(dy[i] * u[i]) * sg * (1 + std::fabs(xi)) + 1e-35, 0},
                              "swiglu dg" + at));
      }
    }
}

TEST(Isa, SoftmaxRowsMatchFloat64AtOddLengths) {
  for (const Set& s : sets())
    for (int64_t n : kLengths) {
      const uint64_t sd = seed();
      SCOPED_TRACE(s.name + " n=" + std::to_string(n) + " seed " + std::to_string(sd));
      std::vector<float> r = inputs(n, sd);
      r[0] = 1.0f;  // no edge values here: scores
      double mx = -INFINITY;
      for (float v : r) mx = std::max(mx, static_cast<double>(v));
      EXPECT_EQ(s.row_max(r.data(), n), static_cast<float>(mx));
      std::vector<float> withnan = r;
      withnan[static_cast<size_t>(n - 1)] = std::nanf("");  // NaN is skipped
      double mx2 = -INFINITY;
      for (int64_t j = 0; j + 1 < n; ++j) mx2 = std::max(mx2, static_cast<double>(r[static_cast<size_t>(j)]));
      EXPECT_EQ(s.row_max(withnan.data(), n), static_cast<float>(mx2));
      std::vector<float> e = r;
      const float sum = s.row_exp_sum(e.data(), n, static_cast<float>(mx));
      double want_sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        // The kernel forms x - max in float (as its callers hand it a float max): past |x - max| = 32
        // that difference is already rounded by up to 2^-18 (3.8e-6 of exp's value at -64), so the
        // reference takes the same float difference and the tolerance stays one of exp itself.
        const double w = std::exp(static_cast<double>(r[static_cast<size_t>(j)] - static_cast<float>(mx)));
        want_sum += w;
        EXPECT_NEAR(e[static_cast<size_t>(j)], w, 4e-7 * w + 1e-35) << "exp at " << j;
      }
      EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum);
      // tile_abt: [3, n] · [n, ld] with the columns tail at n
      const int64_t m = 3, k = 5, ld = n + 2;
      std::vector<float> a = inputs(m * k, sd + 3), bt = inputs(k * ld, sd + 4);
      for (auto* v : {&a, &bt})
        for (auto& z : *v) z = std::fmod(z, 3.0f);
      std::vector<float> out(static_cast<size_t>(m * ld), 12345.0f);
      s.tile_abt(out.data(), ld, a.data(), m, k, bt.data(), n);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < ld; ++j) {
          double acc = 0, mag = 0;
          for (int64_t q = 0; q < k; ++q) {
            acc += static_cast<double>(a[i * k + q]) * bt[q * ld + j];
            mag += std::fabs(static_cast<double>(a[i * k + q]) * bt[q * ld + j]);
          }
          ASSERT_NEAR(out[i * ld + j], j < n ? acc : 12345.0, 4e-7 * k * mag + 1e-30) << i << "," << j;
        }
    }
}

// The flex attention's backward loops: Δ's row_dot, the softmax gradient row and the two
// accumulating tile products, with the vector dimension n at the odd lengths (the predicated
// tails); NaN in a score gives NaN in that element only.
TEST(Isa, AttentionGradientRowsAndTileProductsMatchFloat64AtOddLengths) {
  for (const Set& s : sets())
    for (int64_t n : kLengths) {
      const uint64_t sd = seed();
      SCOPED_TRACE(s.name + " n=" + std::to_string(n) + " seed " + std::to_string(sd));
      std::vector<float> a = inputs(n, sd), b = inputs(n, sd + 1);
      for (auto* v : {&a, &b})
        for (auto& z : *v) z = std::fmod(z, 3.0f);
      double dot = 0, mag = 0;
      for (int64_t j = 0; j < n; ++j) dot += double(a[j]) * b[j], mag += std::fabs(double(a[j]) * b[j]);
      EXPECT_NEAR(s.row_dot(a.data(), b.data(), n), dot, 4e-7 * n * mag + 1e-30);
      // P = exp(s − lse), dS = P (dP − Δ); scores at most lse (a softmax row)
      std::vector<float> sc = inputs(n, sd + 2), dp = inputs(n, sd + 3);
      for (auto& z : sc) z = -std::fabs(std::fmod(z, 20.0f));
      if (n >= 17) sc[5] = std::nanf(""), sc[6] = -INFINITY;
      const float lse = 0.25f, delta = 0.75f;
      std::vector<float> p = sc, d = dp;
      s.row_softmax_grad(p.data(), d.data(), n, lse, delta);
      for (int64_t j = 0; j < n; ++j) {
        const double pj = std::exp(double(sc[j]) - lse), dj = pj * (double(dp[j]) - delta);
        const std::string at = " at " + std::to_string(j) + " s=" + std::to_string(sc[j]);
        // fast_expf's ~2 ulp and the f32 rounding of s − lse (|s − lse| · 2^-24 relative in exp)
        const double rel = 4e-7 + (std::isfinite(sc[j]) ? 1.2e-7 * std::fabs(double(sc[j]) - lse) : 0.0);
        EXPECT_TRUE(all_close(p[j], pj, {rel * pj + 1e-35, 0}, "P" + at));
        EXPECT_TRUE(all_close(d[j], dj, {rel * pj * (std::fabs(double(dp[j])) + delta) + 1e-35, 0}, "dS" + at));
      }
      // acc [rows, n] += w [rows, ld] · x [cols, n] and acc [cols, n] += wᵀ [cols, rows] · x2 [rows, n]
      const int64_t rows = 3, cols = 5, ld = cols + 2;
      std::vector<float> w = inputs(rows * ld, sd + 4), x = inputs(cols * n, sd + 5), x2 = inputs(rows * n, sd + 6);
      std::vector<float> acc = inputs(rows * n, sd + 7), acc2 = inputs(cols * n, sd + 8);
      for (auto* v : {&w, &x, &x2, &acc, &acc2})
        for (auto& z : *v) z = std::fmod(z, 3.0f);
      std::vector<float> got = acc, got2 = acc2;
      s.tile_ax(got.data(), n, w.data(), ld, rows, x.data(), cols);
      s.tile_atx(got2.data(), n, w.data(), ld, rows, x2.data(), cols);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < n; ++e) {
          double want = acc[r * n + e], m = std::fabs(want);
          for (int64_t c = 0; c < cols; ++c)
            want += double(w[r * ld + c]) * x[c * n + e], m += std::fabs(double(w[r * ld + c]) * x[c * n + e]);
          ASSERT_NEAR(got[r * n + e], want, 4e-7 * cols * m + 1e-30) << "tile_ax " << r << "," << e;
        }
      for (int64_t c = 0; c < cols; ++c)
        for (int64_t e = 0; e < n; ++e) {
          double want = acc2[c * n + e], m = std::fabs(want);
          for (int64_t r = 0; r < rows; ++r)
            want += double(w[r * ld + c]) * x2[r * n + e], m += std::fabs(double(w[r * ld + c]) * x2[r * n + e]);
          ASSERT_NEAR(got2[c * n + e], want, 4e-7 * rows * m + 1e-30) << "tile_atx " << c << "," << e;
        }
    }
}

TEST(Isa, SveTableRowsAndCastsMatchReferences) {
  const isa::SveKernels* k = isa::sve_available();
  if (!k) GTEST_SKIP() << "no SVE on this CPU (" << isa::cpu_features().kernels << ")";
  for (int64_t n : kLengths) {
    const uint64_t sd = seed();
    SCOPED_TRACE("n=" + std::to_string(n) + " seed " + std::to_string(sd));
    // RMSNorm rows (2 rows of n), forward and backward, vs double.
    std::vector<float> x = inputs(2 * n, sd), w = inputs(n, sd + 1), dy = inputs(2 * n, sd + 2);
    for (auto& z : x) z = std::fmod(z, 4.0f);
    std::vector<float> y(x.size()), rstd(2), dx(x.size());
    std::vector<double> part(static_cast<size_t>(n), 0.5);
    k->rms_norm_rows_f32(y.data(), rstd.data(), x.data(), w.data(), 2, n, 1e-6);
    k->rms_norm_backward_rows_f32(dx.data(), part.data(), dy.data(), x.data(), w.data(), rstd.data(), 0, 2, n);
    std::vector<double> want_part(static_cast<size_t>(n), 0.5);
    for (int64_t r = 0; r < 2; ++r) {
      double ss = 0, dot = 0;
      for (int64_t c = 0; c < n; ++c) ss += double(x[r * n + c]) * x[r * n + c];
      const double rs = 1 / std::sqrt(ss / n + 1e-6);
      EXPECT_NEAR(rstd[r], rs, 1e-6 * rs);
      const double rsf = rstd[r];
      for (int64_t c = 0; c < n; ++c) dot += double(dy[r * n + c]) * w[c] * x[r * n + c];
      for (int64_t c = 0; c < n; ++c) {
        const double yc = x[r * n + c] * rs * w[c];
        EXPECT_NEAR(y[r * n + c], yc, 2e-6 * std::fabs(yc) + 1e-30);
        const double dxc = dy[r * n + c] * double(w[c]) * rsf - x[r * n + c] * dot * rsf * rsf * rsf / n;
        const double gwr = std::fabs(double(dy[r * n + c]) * double(w[c]) * rsf);
        EXPECT_NEAR(dx[r * n + c], dxc, 2e-6 * (std::fabs(dxc) + gwr) + 1e-30);
        want_part[c] += double(dy[r * n + c]) * x[r * n + c] * rsf;
      }
    }
    for (int64_t c = 0; c < n; ++c) EXPECT_NEAR(part[c], want_part[c], 1e-12 * (1 + std::fabs(want_part[c])));
    // AdamW vs kernels/optim.h's adamw_update in double.
    kernels::AdamWStep st;
    st.lr_wd = 1e-3f, st.beta1 = 0.9f, st.beta2 = 0.999f, st.one_minus_beta1 = 0.1f, st.one_minus_beta2 = 0.001f;
    st.step_size = 1e-2f, st.bias_correction2_sqrt = 0.3f, st.eps = 1e-8f;
    std::vector<float> p = inputs(n, sd + 3), m = inputs(n, sd + 4), v = inputs(n, sd + 5), g = inputs(n, sd + 6);
    for (auto& z : v) z = std::fabs(z);
    std::vector<float> p1 = p, m1 = m, v1 = v;
    std::vector<uint16_t> gb(g.size());
    for (size_t i = 0; i < g.size(); ++i) gb[i] = BFloat16(g[i]).bits;
    std::vector<float> p2 = p, m2 = m, v2 = v;
    k->adamw_f32(p1.data(), m1.data(), v1.data(), g.data(), n, st, 1.0f);
    k->adamw_bf16(p2.data(), m2.data(), v2.data(), gb.data(), n, st, 1.0f);
    for (int64_t i = 0; i < n; ++i)
      for (int pass = 0; pass < 2; ++pass) {
        const double gi = pass ? double(float(BFloat16::from_bits(gb[i]))) : double(g[i]);
        double pi = p[i] - double(st.lr_wd) * p[i];
        const double mi = double(st.beta1) * m[i] + double(st.one_minus_beta1) * gi;
        const double vi = double(st.beta2) * v[i] + double(st.one_minus_beta2) * gi * gi;
        const double upd = double(st.step_size) * (mi / (std::sqrt(vi) / double(st.bias_correction2_sqrt) + st.eps));
        pi -= upd;
        const auto& P = pass ? p2 : p1;
        const auto& M = pass ? m2 : m1;
        const auto& V = pass ? v2 : v1;
        EXPECT_NEAR(P[i], pi, 4e-7 * (std::fabs(pi) + std::fabs(upd)));
        EXPECT_NEAR(M[i], mi, 4e-7 * (std::fabs(double(st.beta1) * m[i]) + std::fabs(0.1 * gi)) + 1e-30);
        EXPECT_NEAR(V[i], vi, 4e-7 * std::fabs(vi) + 1e-30);
      }
    // Casts: BFloat16's bits exactly, NaN payloads, infinities, denormals and the overflow to inf.
    std::vector<float> c = inputs(n, sd + 7);
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), -INFINITY, 3.4028235e38f, 1e-40f, -0.0f};
    for (size_t i = 0; i < std::size(specials) && i < c.size(); ++i) c[c.size() - 1 - i] = specials[i];
    std::vector<uint16_t> cb(c.size());
    std::vector<float> back(c.size());
    k->f32_to_bf16(cb.data(), c.data(), n);
    k->bf16_to_f32(back.data(), cb.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(cb[i], BFloat16(c[i]).bits) << "f32 -> bf16 of " << c[i];
      const float want = BFloat16::from_bits(cb[i]);
      ASSERT_EQ(std::memcmp(&back[i], &want, 4), 0) << "bf16 -> f32 of " << cb[i];
    }
  }
}
