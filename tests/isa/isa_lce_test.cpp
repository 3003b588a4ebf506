// The fused loss's row loops (kernels/cpu/lce_rows.h) in every kernel set this CPU has: the
// entries (SVE under qemu's sve128 / sve256 for f32 rows without soft cap, else the portable
// loops), the portable loops themselves, and the SVE table. At odd lengths (1, 3, 17, 129, 1000:
// every predicated tail at 128 and 256 bits): bias + max bit for bit against the portable loop,
// the sums, exps and gradient rows against float64, NaN and inf as the portable loops give them,
// and the dispatch (SVE only where the seam applies).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kiln/kernels/cpu/isa/isa.h"
#include "kiln/kernels/cpu/lce_rows.h"

using namespace kiln;
namespace isa = kiln::kernels::cpu::isa;
namespace rows = kiln::kernels::cpu::lce_rows;

namespace {

constexpr int64_t kLengths[] = {1, 3, 17, 129, 1000};

// One f32 kernel set: the row loops without soft cap.
struct Set {
  std::string name;
  float (*logits_max)(float* z, const float* bias, int64_t v);
  float (*weighted_sum)(const float* w, const float* z, int64_t v);
  float (*exp_sum)(float* z, int64_t v, float mx, bool keep);
  void (*grad_row)(float* z, int64_t v, const isa::LceGradRowF32& g);
};

rows::GradRow<float> grad_args(const isa::LceGradRowF32& g, bool keep) {
  rows::GradRow<float> r;
  r.terms.p_coef = g.p_coef, r.terms.target_coef = g.target_coef, r.terms.smooth_coef = g.smooth_coef;
  r.w = g.w, r.target = g.target, r.inv_sum = g.inv_sum, r.filter = g.filter, r.scale = g.scale, r.keep_exp = keep;
  return r;
}

std::vector<Set> sets() {
  std::vector<Set> v{
      {"entry (" + isa::cpu_features().kernels + ")",
       [](float* z, const float* b, int64_t n) { return rows::logits_max(z, b, n, 0.0f); },
       [](const float* w, const float* z, int64_t n) { return rows::weighted_sum(w, z, n); },
       [](float* z, int64_t n, float mx, bool keep) { return rows::exp_sum(z, n, mx, keep); },
       [](float* z, int64_t n, const isa::LceGradRowF32& g) { rows::grad_row(z, n, grad_args(g, true)); }},
      {"portable",
       [](float* z, const float* b, int64_t n) { return rows::logits_max_portable<float>(z, b, n, 0.0f); },
       [](const float* w, const float* z, int64_t n) { return rows::weighted_sum_portable<float>(w, z, n); },
       [](float* z, int64_t n, float mx, bool keep) { return rows::exp_sum_portable<float>(z, n, mx, keep); },
       [](float* z, int64_t n, const isa::LceGradRowF32& g) { rows::grad_row_portable<float>(z, n, grad_args(g, true)); }}};
  if (const auto* k = isa::sve_available())
    v.push_back({"sve table", k->lce_logits_max_f32, k->lce_weighted_sum_f32, k->lce_exp_sum_f32, k->lce_grad_row_f32});
  return v;
}

std::vector<float> normal(int64_t n, uint64_t seed, float sd) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& e : x) e = d(g);
  return x;
}

uint64_t seed() { return std::random_device{}(); }

}  // namespace

TEST(IsaLce, BiasAndMaxAreThePortableBits) {
  for (const Set& s : sets())
    for (int64_t n : kLengths)
      for (bool with_bias : {false, true}) {
        const uint64_t sd = seed();
        SCOPED_TRACE(s.name + " n=" + std::to_string(n) + " bias " + std::to_string(with_bias) + " seed " +
                     std::to_string(sd));
        std::vector<float> z = normal(n, sd, 6.0f), bias = normal(n, sd + 1, 2.0f);
        if (n >= 17) z[5] = std::nanf(""), z[6] = -INFINITY;  // NaN skipped by the max, -inf kept
        std::vector<float> got = z, want = z;
        const float* b = with_bias ? bias.data() : nullptr;
        const float mx = s.logits_max(got.data(), b, n);
        const float want_mx = rows::logits_max_portable<float>(want.data(), b, n, 0.0f);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << "z + bias differs";
        EXPECT_EQ(mx, want_mx);
        double ref = -INFINITY;  // the max in double of the f32 sums (exact)
        for (int64_t j = 0; j < n; ++j) {
          const float x = with_bias ? z[j] + bias[j] : z[j];
          if (!std::isnan(x)) ref = std::max(ref, static_cast<double>(x));
        }
        EXPECT_EQ(static_cast<double>(mx), ref);
      }
}

TEST(IsaLce, SumsAndExpsMatchFloat64AtOddLengths) {
  for (const Set& s : sets())
    for (int64_t n : kLengths) {
      const uint64_t sd = seed();
      SCOPED_TRACE(s.name + " n=" + std::to_string(n) + " seed " + std::to_string(sd));
      std::vector<float> z = normal(n, sd, 1.5f), w = normal(n, sd + 1, 1.0f);
      // The row's largest term last, in the predicated tail at every odd length: a tail lost
      // or summed twice moves the sums by far more than their tolerance.
      float top = -INFINITY;
      for (float x : z) top = std::max(top, x);
      z[n - 1] = top + 1.0f;
      for (const float* wp : {static_cast<const float*>(nullptr), static_cast<const float*>(w.data())}) {
        double want = 0, mag = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double t = (wp ? double(wp[j]) : 1.0) * z[j];
          want += t, mag += std::fabs(t);
        }
        EXPECT_NEAR(s.weighted_sum(wp, z.data(), n), want, 1e-5 * mag + 1e-30) << "weights " << (wp != nullptr);
      }
      if (n >= 3) z[0] = -INFINITY, z[1] = -100.0f;  // exp gives 0 (and flushes below -87.3)
      const float mx = z[n - 1];
      // exp of the f32 difference the kernels form (its rounding is the input's, not exp's)
      auto want_exp = [&](int64_t j) { return std::exp(static_cast<double>(z[j] - mx)); };
      double want_sum = 0;
      for (int64_t j = 0; j < n; ++j) want_sum += want_exp(j);
      for (bool keep : {false, true}) {
        std::vector<float> e = z;
        const float sum = s.exp_sum(e.data(), n, mx, keep);
        EXPECT_NEAR(sum, want_sum, 2e-6 * want_sum) << "keep " << keep;
        if (!keep) {
          EXPECT_EQ(std::memcmp(e.data(), z.data(), e.size() * 4), 0) << "exp_sum without keep wrote the row";
          continue;
        }
        for (int64_t j = 0; j < n; ++j) {
          const double x = want_exp(j);
          if (z[j] - mx < -87.3f) {
            EXPECT_LE(e[j], 1.2e-38f) << "exp at " << j;  // 0 (SVE) or the denormal (libm)
          } else {
            EXPECT_NEAR(e[j], x, 4e-7 * x + 1e-35) << "exp at " << j;
          }
        }
      }
    }
}

TEST(IsaLce, NanAndInfinityPropagateAsInThePortableLoops) {
  for (const Set& s : sets())
    for (int64_t n : kLengths) {
      if (n < 3) continue;
      SCOPED_TRACE(s.name + " n=" + std::to_string(n));
      std::vector<float> z = normal(n, seed(), 3.0f);
      std::vector<float> nan_row = z;
      nan_row[n / 2] = std::nanf("");
      const float mx = s.logits_max(nan_row.data(), nullptr, n);
      EXPECT_FALSE(std::isnan(mx));
      EXPECT_TRUE(std::isnan(s.exp_sum(nan_row.data(), n, mx, true))) << "a NaN logit makes the row's sum NaN";
      EXPECT_TRUE(std::isnan(nan_row[n / 2]));
      std::vector<float> inf_row = z;
      inf_row[n - 1] = INFINITY;
      const float imx = s.logits_max(inf_row.data(), nullptr, n);
      EXPECT_EQ(imx, INFINITY);
      EXPECT_TRUE(std::isnan(s.exp_sum(inf_row.data(), n, imx, false))) << "+inf − +inf is NaN, as with std::exp";
      std::vector<float> ninf = z;
      ninf[0] = -INFINITY;
      const float nmx = s.logits_max(ninf.data(), nullptr, n);
      const float sum = s.exp_sum(ninf.data(), n, nmx, true);
      EXPECT_TRUE(std::isfinite(sum));
      EXPECT_EQ(ninf[0], 0.0f);
    }
}

TEST(IsaLce, GradientRowsMatchFloat64AtOddLengths) {
  for (const Set& s : sets())
    for (int64_t n : kLengths)
      for (int variant = 0; variant < 4; ++variant) {
        const uint64_t sd = seed();
        SCOPED_TRACE(s.name + " n=" + std::to_string(n) + " variant " + std::to_string(variant) + " seed " +
                     std::to_string(sd));
        std::mt19937_64 g(sd);
        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        std::vector<float> e(static_cast<size_t>(n)), w = normal(n, sd + 1, 1.0f);
        for (auto& x : e) x = u(g);
        isa::LceGradRowF32 a{};
        a.w = (variant & 1) ? w.data() : nullptr;
        a.target = variant == 0 ? 0 : variant == 1 ? n - 1 : static_cast<int64_t>(g() % static_cast<uint64_t>(n));
        a.inv_sum = 1.0f / (1.0f + u(g) * float(n));
        a.p_coef = 0.5f + u(g), a.target_coef = 0.9f, a.smooth_coef = 0.1f / float(n);
        a.filter = (variant & 2) ? 1e-3f : 0.0f;
        a.scale = 0.25f + u(g);
        std::vector<float> z = e;
        s.grad_row(z.data(), n, a);
        for (int64_t j = 0; j < n; ++j) {
          const double p = double(e[j]) * a.inv_sum, wj = a.w ? double(a.w[j]) : 1.0;
          const double t = j == a.target ? double(a.target_coef) : 0.0;
          const double dz = p * a.p_coef - wj * a.smooth_coef - t;
          const double tol = 4e-7 * (std::fabs(p * a.p_coef) + std::fabs(wj * a.smooth_coef) + t);
          if (a.filter > 0 && std::fabs(dz) < a.filter - tol) {
            EXPECT_EQ(z[j], 0.0f) << "filtered at " << j;
          } else if (a.filter == 0 || std::fabs(dz) > a.filter + tol) {
            EXPECT_NEAR(z[j], dz * a.scale, tol * a.scale + 1e-35) << "at " << j << (j == a.target ? " (target)" : "");
          }
        }
      }
}

TEST(IsaLce, TheSveSeamTakesF32RowsWithoutSoftCapOnly) {
  std::vector<float> z{0.5f, -1.0f, 2.0f}, b{1.0f, 1.0f, 1.0f};
  std::vector<double> zd{0.5, -1.0, 2.0};
  const uint64_t c0 = isa::sve_calls();
  rows::logits_max(z.data(), b.data(), 3, 0.0f);
  const uint64_t c1 = isa::sve_calls();
  rows::logits_max(z.data(), nullptr, 3, 30.0f);  // soft cap: tanh, portable
  rows::logits_max(zd.data(), nullptr, 3, 0.0);   // f64: portable
  rows::exp_sum(zd.data(), 3, 2.0, true);
  const uint64_t c2 = isa::sve_calls();
  rows::exp_sum(z.data(), 3, 3.0f, true);
  rows::GradRow<float> g;
  g.keep_exp = true, g.inv_sum = 0.5f, g.terms.p_coef = 1.0f, g.target = 1;
  rows::grad_row(z.data(), 3, g);
  g.keep_exp = false;  // p = exp(z − lse): the soft-capped rows' path, portable
  rows::grad_row(z.data(), 3, g);
  const uint64_t c3 = isa::sve_calls();
  const uint64_t want = isa::sve() ? 1 : 0;
  EXPECT_EQ(c1 - c0, want) << "f32 logits_max without soft cap";
  EXPECT_EQ(c2 - c1, 0u) << "soft cap and f64 stay portable";
  EXPECT_EQ(c3 - c2, 2 * want) << "exp_sum and the kept-exp gradient row";
}
