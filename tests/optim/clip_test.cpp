// clip_grad_norm_ vs a float64 reference of torch.nn.utils.clip_grad_norm_: norm orders 2, 1,
// 3 and inf, clipping and not, gradients spanning several chunks, non-contiguous and bf16
// gradients, parameters without gradients, non-finite norms, thread-count independence.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "helpers.h"
#include "kiln/optim/clip.h"

using namespace kiln;
using namespace kiln::optim;
using namespace kiln::optim::test;
using namespace kiln::test;

namespace {

double ref_norm(const std::vector<std::vector<double>>& gs, double p) {
  double acc = 0;
  for (const auto& g : gs)
    for (double x : g) acc = std::isinf(p) ? std::max(acc, std::fabs(x)) : acc + std::pow(std::fabs(x), p);
  return std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
}

// Parameters {1}, {7}, {129, 3} (transposed gradient), {20000} (3 chunks), one without grad.
NamedTensors with_grads(uint64_t seed, double scale, DType dtype = DType::f32) {
  NamedTensors ps = make_params({{1}, {7}, {129, 3}, {20000}, {5}}, seed);
  Generator gen(seed + 1);
  ps[0].second.set_grad(randn({1}, gen, dtype) * scale);
  ps[1].second.set_grad(randn({7}, gen, dtype) * scale);
  ps[2].second.set_grad((randn({3, 129}, gen, dtype) * scale).t());
  ps[3].second.set_grad(randn({20000}, gen, dtype) * scale);
  return ps;  // ps[4] has no gradient
}

std::vector<std::vector<double>> grads_f64(const NamedTensors& ps) {
  std::vector<std::vector<double>> out;
  for (const auto& [n, p] : ps)
    if (p.grad().defined()) out.push_back(as_f64(p.grad()));
  return out;
}

}  // namespace

TEST(ClipGradNorm, MatchesFloat64Reference) {
  for (double p : {2.0, 1.0, 3.0, static_cast<double>(INFINITY)}) {
    for (double max_norm : {1e9, 0.5}) {  // not clipped, clipped
      SCOPED_TRACE(std::string("p=") + std::to_string(p) + std::string(" max_norm=") + std::to_string(max_norm));
      NamedTensors ps = with_grads(3, 0.1);
      ASSERT_FALSE(ps[2].second.grad().is_contiguous());
      auto before = grads_f64(ps);
      const double want = ref_norm(before, p);
      ClipGradOptions o;
      o.norm_type = p;
      const double got = clip_grad_norm_(ps, max_norm, o);
      EXPECT_NEAR(got, want, 1e-12 * want);
      const double coef = max_norm / (want + 1e-6);
      auto after = grads_f64(ps);
      for (size_t i = 0; i < before.size(); ++i) {
        std::vector<double> expect = before[i];
        if (coef < 1.0)
          for (double& x : expect) x *= coef;
        EXPECT_TRUE(all_close(after[i], expect, finite_only({0, coef < 1.0 ? 2e-7 : 0.0}),
                              std::string("grad ") + std::to_string(i)));
      }
      if (coef < 1.0) {
        EXPECT_NEAR(ref_norm(after, p), max_norm, 1e-5 * max_norm);
      }
      EXPECT_FALSE(ps[4].second.grad().defined());
    }
  }
}

TEST(ClipGradNorm, Bf16Gradients) {
  NamedTensors ps = with_grads(4, 1.0, DType::bf16);
  auto before = grads_f64(ps);
  const double want = ref_norm(before, 2.0);
  EXPECT_NEAR(clip_grad_norm_(ps, 1.0), want, 1e-12 * want);
  auto after = grads_f64(ps);
  const double coef = 1.0 / (want + 1e-6);
  for (size_t i = 0; i < before.size(); ++i) {
    std::vector<double> expect = before[i];
    for (double& x : expect) x *= coef;
    EXPECT_TRUE(
        all_close(after[i], expect, finite_only({0, 1.0 / 128}), std::string("bf16 grad ") + std::to_string(i)));
  }
}

// sum_of_norm_partials (what FSDP sums over ranks): the f64 reference's sum of |g|^p (max for
// inf); contiguous f32 / bf16 gradients take one multi-tensor call, a list with a transposed or
// f64 gradient one call per gradient: the same partials, so the same bits either way.
TEST(ClipGradNorm, SumOfPartialsOneCallOrOnePerGradientSameBits) {
  Generator gen(21);
  const std::vector<Tensor> contiguous = {randn({7}, gen), randn({20000}, gen).to(DType::bf16), randn({129, 3}, gen),
                                          randn({0}, gen)};
  for (double p : {2.0, 1.0, static_cast<double>(INFINITY)}) {
    SCOPED_TRACE(std::to_string(p));
    std::vector<std::vector<double>> f64;
    for (const Tensor& g : contiguous) f64.push_back(as_f64(g));
    const double ref = ref_norm(f64, p), want = std::isinf(p) ? ref : std::pow(ref, p);
    const double multi = sum_of_norm_partials(contiguous, p);
    EXPECT_NEAR(multi, want, 1e-12 * want);
    // The same values with a strided copy of the third and an f64 tensor appended as zeros: per gradient.
    std::vector<Tensor> mixed = contiguous;
    mixed[2] = contiguous[2].t().contiguous().t();
    ASSERT_FALSE(mixed[2].is_contiguous());
    mixed.push_back(zeros({5}, DType::f64));
    const double each = sum_of_norm_partials(mixed, p);
    EXPECT_EQ(std::memcmp(&multi, &each, sizeof multi), 0) << multi << " vs " << each;
  }
  EXPECT_EQ(sum_of_norm_partials({}, 2.0), 0.0);
  EXPECT_THROW(sum_of_norm_partials(contiguous, -1.0), Error);
}

TEST(ClipGradNorm, IndependentOfThreadCount) {
  const int threads = omp_get_max_threads();
  NamedTensors ps = with_grads(5, 1.0);
  omp_set_num_threads(1);
  const double one = grad_norm({ps[3].second, ps[2].second});
  omp_set_num_threads(std::max(2, threads));
  const double many = grad_norm({ps[3].second, ps[2].second});
  omp_set_num_threads(threads);
  EXPECT_EQ(std::memcmp(&one, &many, sizeof one), 0) << one << " vs " << many;
}

TEST(ClipGradNorm, NonFiniteLeavesGradientsOrThrows) {
  for (float bad : {NAN, INFINITY}) {
    NamedTensors ps = with_grads(6, 1.0);
    Tensor g = ps[3].second.grad();
    std::vector<float> v = g.to_vector<float>();
    v[12345] = bad;
    ps[3].second.set_grad(from_vector<float>(v, {20000}));
    auto before = grads_f64(ps);
    const double n = clip_grad_norm_(ps, 1.0);
    EXPECT_FALSE(std::isfinite(n));
    if (std::isinf(bad)) {
      EXPECT_TRUE(std::isinf(n));
    }
    auto after = grads_f64(ps);
    for (size_t i = 0; i < before.size(); ++i)
      for (size_t k = 0; k < before[i].size(); ++k)
        if (!std::isnan(before[i][k])) {
          ASSERT_EQ(before[i][k], after[i][k]);
        }
    ClipGradOptions o;
    o.error_if_nonfinite = true;
    EXPECT_THROW(clip_grad_norm_(ps, 1.0, o), Error);
    o.norm_type = INFINITY;
    EXPECT_THROW(clip_grad_norm_(ps, 1.0, o), Error);
  }
}

TEST(ClipGradNorm, EdgeCasesAndBadArguments) {
  NamedTensors none = make_params({{3}}, 1);
  EXPECT_EQ(clip_grad_norm_(none, 1.0), 0.0);
  NamedTensors ps = with_grads(7, 1.0);
  EXPECT_THROW(clip_grad_norm_(ps, -1.0), Error);
  EXPECT_THROW(clip_grad_norm_(ps, NAN), Error);
  ClipGradOptions o;
  o.norm_type = 0.0;
  EXPECT_THROW(clip_grad_norm_(ps, 1.0, o), Error);
  o.norm_type = -2.0;
  EXPECT_THROW(clip_grad_norm_(ps, 1.0, o), Error);
  // No gradients at all still checks norm_type (it returned 0 for norm_type -1).
  o.norm_type = -1.0;
  EXPECT_THROW(clip_grad_norm_(none, 1.0, o), Error);
  // max_norm inf measures without clipping, as torch.
  const std::vector<std::vector<double>> before = grads_f64(ps);
  EXPECT_GT(clip_grad_norm_(ps, INFINITY), 0.0);
  EXPECT_EQ(grads_f64(ps), before);
  // f64 gradients scale in f64: a coefficient of 2e-51 rounded to f32 was 0.
  Tensor p64 = zeros({2});
  p64.requires_grad_();
  p64.set_grad(from_vector<double>({3e50, 4e50}, {2}));
  EXPECT_DOUBLE_EQ(clip_grad_norm_(std::vector<Tensor>{p64}, 1.0), 5e50);
  const auto g64 = p64.grad().to_vector<double>();
  EXPECT_NEAR(g64[0], 0.6, 1e-12);
  EXPECT_NEAR(g64[1], 0.8, 1e-12);
  // max_norm 0 zeroes the gradients.
  clip_grad_norm_(ps, 0.0);
  for (const auto& g : grads_f64(ps))
    for (double x : g) ASSERT_EQ(x, 0.0);
}
