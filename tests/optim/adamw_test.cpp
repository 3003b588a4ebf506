// AdamW vs a float64 implementation of torch.optim.AdamW's formulas: several steps with a
// changing lr, with and without weight decay, a decay filter, bf16 gradients, parameters
// skipped when they have no gradient, non-contiguous parameters and gradients; plus
// argument checks.
#include <gtest/gtest.h>

#include <cmath>

#include "helpers.h"
#include "kiln/optim/adamw.h"
#include "kiln/optim/sgd.h"

using namespace kiln;
using namespace kiln::optim;
using namespace kiln::optim::test;
using namespace kiln::test;

namespace {

// torch.optim.AdamW in float64 (amsgrad off, maximize off).
struct RefAdamW {
  double lr, beta1, beta2, eps, wd;
  std::vector<std::vector<double>> p, m, v;
  std::vector<int64_t> t;
  std::vector<bool> decay;

  void step(size_t i, const std::vector<double>& g) {
    auto& P = p[i];
    if (m[i].empty()) {
      m[i].assign(P.size(), 0.0);
      v[i].assign(P.size(), 0.0);
    }
    const int64_t step = ++t[i];
    const double w = decay[i] ? wd : 0.0;
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    for (size_t k = 0; k < P.size(); ++k) {
      P[k] *= 1.0 - lr * w;
      m[i][k] = beta1 * m[i][k] + (1.0 - beta1) * g[k];
      v[i][k] = beta2 * v[i][k] + (1.0 - beta2) * g[k] * g[k];
      const double denom = std::sqrt(v[i][k]) / std::sqrt(bc2) + eps;
      P[k] -= lr / bc1 * m[i][k] / denom;
    }
  }
};

struct Case {
  const char* name;
  double weight_decay;
  double eps;
  bool filter;  // decay_matrices_only
  DType grad_dtype;
};

void run_case(const Case& c) {
  SCOPED_TRACE(c.name);
  const std::vector<Shape> shapes = {{1}, {7}, {129}, {3, 5, 7}, {300, 129}};
  NamedTensors ps = make_params(shapes, 11);
  AdamWOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.8;
  o.beta2 = 0.95;
  o.eps = c.eps;
  o.weight_decay = c.weight_decay;
  if (c.filter) o.decay = decay_matrices_only;
  AdamW opt(ps, o);

  RefAdamW ref{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, {}, {}, {}, {}, {}};
  for (size_t i = 0; i < ps.size(); ++i) {
    ref.p.push_back(as_f64(ps[i].second));
    ref.m.emplace_back();
    ref.v.emplace_back();
    ref.t.push_back(0);
    ref.decay.push_back(!c.filter || shapes[i].size() >= 2);
    EXPECT_EQ(opt.decays(i), ref.decay[i]);
  }
  Generator gen(99);
  const int kSteps = 6;
  for (int s = 0; s < kSteps; ++s) {
    const double lr = 1e-2 * (1.0 + 0.25 * s);  // changing lr, as a schedule does
    opt.set_lr(lr);
    ref.lr = lr;
    for (size_t i = 0; i < ps.size(); ++i) {
      // Parameter 1 has no gradient on steps 0 and 3: it is skipped, as torch.
      if (i == 1 && (s == 0 || s == 3)) {
        ps[i].second.set_grad(Tensor());
        continue;
      }
      Tensor g = randn(shapes[i], gen, c.grad_dtype);
      ps[i].second.set_grad(g);
      ref.step(i, as_f64(g));
    }
    Tensor before = ps[1].second.detach().clone();
    opt.step();
    if (s == 0 || s == 3) {
      EXPECT_TRUE(same_bits(before, ps[1].second)) << "skipped parameter changed";
    }
  }
  EXPECT_EQ(opt.step_count(), kSteps);
  OptimizerState st = opt.state_dict();
  for (size_t i = 0; i < ps.size(); ++i) {
    const std::string& n = ps[i].first;
    // Parameters of order 1 move by about lr per step; f32 rounding stays far below.
    EXPECT_TRUE(all_close(as_f64(ps[i].second), ref.p[i], finite_only({2e-6, 2e-6}), n));
    const Tensor* m = find_tensor(st, "exp_avg." + n);
    const Tensor* v = find_tensor(st, "exp_avg_sq." + n);
    ASSERT_TRUE(m && v) << n;
    EXPECT_TRUE(all_close(as_f64(*m), ref.m[i], finite_only({1e-6, 1e-5}), "exp_avg." + n));
    EXPECT_TRUE(all_close(as_f64(*v), ref.v[i], finite_only({1e-7, 1e-5}), "exp_avg_sq." + n));
    EXPECT_EQ(st.scalars.find("param_steps")->find(n)->as_int(), ref.t[i]) << n;
  }
}

}  // namespace

TEST(AdamW, MatchesFloat64ReferenceWithoutWeightDecay) { run_case({"wd=0", 0.0, 1e-8, false, DType::f32}); }
TEST(AdamW, MatchesFloat64ReferenceWithWeightDecay) { run_case({"wd=0.1", 0.1, 1e-8, false, DType::f32}); }
TEST(AdamW, MatchesFloat64ReferenceWithDecayFilter) { run_case({"filter", 0.3, 1e-8, true, DType::f32}); }
// A large eps makes its place in the formula (after the bias-corrected sqrt) visible.
TEST(AdamW, MatchesFloat64ReferenceWithLargeEps) { run_case({"eps=0.5", 0.1, 0.5, false, DType::f32}); }
TEST(AdamW, MatchesFloat64ReferenceWithBf16Grads) { run_case({"bf16", 0.1, 1e-8, true, DType::bf16}); }

TEST(AdamW, NonContiguousParameterAndGradient) {
  Generator gen(5);
  Tensor base = randn({6, 9}, gen);
  Tensor p = base.t();  // [9, 6], strides {1, 9}: a leaf view
  ASSERT_FALSE(p.is_contiguous());
  p.requires_grad_();
  Tensor q = p.detach().contiguous();
  q.requires_grad_();
  AdamWOptions o;
  o.lr = 0.05;
  o.weight_decay = 0.2;
  AdamW a({{"w", p}}, o), b({{"w", q}}, o);
  for (int s = 0; s < 3; ++s) {
    Tensor g = randn({6, 9}, gen).t();  // non-contiguous gradient
    p.set_grad(g);
    q.set_grad(g.contiguous());
    a.step();
    b.step();
  }
  EXPECT_TRUE(same_bits(p, q));
  // The parameter's storage itself was updated.
  EXPECT_TRUE(same_bits(base.t(), q));
}

TEST(AdamW, StepBumpsParameterVersion) {
  NamedTensors ps = make_params({{4}}, 1);
  AdamW opt(ps);
  Generator gen(2);
  ps[0].second.set_grad(randn({4}, gen));
  const uint64_t v0 = ps[0].second.version();
  opt.step();
  EXPECT_GT(ps[0].second.version(), v0);
}

TEST(AdamW, ZeroGrad) {
  NamedTensors ps = make_params({{3}, {2, 2}}, 1);
  AdamW opt(ps);
  Generator gen(2);
  ps[0].second.set_grad(randn({3}, gen));
  ps[1].second.set_grad(randn({2, 2}, gen));
  opt.zero_grad(false);
  EXPECT_EQ(ps[0].second.grad().to_vector<float>(), std::vector<float>(3, 0.0f));
  EXPECT_EQ(ps[1].second.grad().to_vector<float>(), std::vector<float>(4, 0.0f));
  opt.zero_grad();
  EXPECT_FALSE(ps[0].second.grad().defined());
  EXPECT_FALSE(ps[1].second.grad().defined());
  // A step with no gradients changes nothing but the step count.
  Tensor before = ps[0].second.detach().clone();
  opt.step();
  EXPECT_TRUE(same_bits(before, ps[0].second));
  EXPECT_EQ(opt.step_count(), 1);
  EXPECT_TRUE(opt.state_dict().tensors.empty());
}

TEST(AdamW, RejectsBadHyperparameters) {
  auto make = [](AdamWOptions o) { AdamW opt(make_params({{2}}, 1), o); };
  AdamWOptions o;
  o.lr = -1e-3;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.beta1 = 1.0;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.beta2 = -0.1;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.beta2 = 1.0;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.eps = -1.0;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.weight_decay = -0.1;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.lr = std::nan("");
  EXPECT_THROW(make(o), Error);
  EXPECT_NO_THROW(make(AdamWOptions{}));

  AdamW opt(make_params({{2}}, 1));
  try {
    opt.set_lr(-0.5);
    FAIL() << "set_lr(-0.5) accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lr=-0.5"), std::string::npos) << e.what();
  }
  EXPECT_THROW(opt.set_lr(INFINITY), Error);
  opt.set_lr(0.25);
  EXPECT_EQ(opt.lr(), 0.25);
}

TEST(AdamW, RejectsBadParameters) {
  EXPECT_THROW(AdamW(NamedTensors{}), Error);
  NamedTensors ps = make_params({{2}, {3}}, 1);
  ps[1].first = ps[0].first;
  EXPECT_THROW(AdamW{ps}, Error);  // duplicate name
  ps = make_params({{2}}, 1);
  ps.emplace_back("alias", ps[0].second);
  EXPECT_THROW(AdamW{ps}, Error);  // same tensor twice
  Tensor h = zeros({2}, DType::bf16);
  EXPECT_THROW(AdamW(NamedTensors{{"h", h}}), Error);  // not f32
  EXPECT_THROW(AdamW(NamedTensors{{"u", Tensor()}}), Error);
  Tensor leaf = zeros({2});
  leaf.requires_grad_();
  Tensor nonleaf = leaf * 2.0;
  EXPECT_THROW(AdamW(NamedTensors{{"n", nonleaf}}), Error);
  // Layouts that reach memory twice (from a probe: an expanded parameter kept only its last
  // row's update; two overlapping views of one buffer were each updated). Disjoint views of one
  // buffer, dense or interleaved, stay allowed; so do permuted and strided views.
  auto expect_error = [](NamedTensors params, const std::string& part) {
    try {
      SGD opt(std::move(params));
      ADD_FAILURE() << "no error, expected one containing '" << part << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  Tensor row = zeros({1, 4});
  expect_error({{"e", row.expand({3, 4})}}, "parameter 'e' reaches some memory through more than one index");
  Tensor flat = zeros({12});
  expect_error({{"a", flat.narrow(0, 0, 6)}, {"b", flat.narrow(0, 4, 8).view({2, 4})}},
               "parameters 'a' and 'b' share memory");
  Tensor m = zeros({4, 6});
  EXPECT_NO_THROW(SGD(NamedTensors{{"lo", flat.narrow(0, 0, 6)}, {"hi", flat.narrow(0, 6, 6).view({2, 3})}}));
  EXPECT_NO_THROW(
      SGD(NamedTensors{{"left", m.narrow(1, 0, 3)}, {"right", m.narrow(1, 3, 3)}, {"t", zeros({3, 5}).t()}}));
  SGD opt(make_params({{2}}, 1));
  EXPECT_TRUE(opt.decays(0));
  try {
    opt.decays(99);
    ADD_FAILURE() << "decays(99) accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("decays(99): there are 1 parameters"), std::string::npos) << e.what();
  }
}

TEST(AdamW, BadGradientLeavesEverythingUnchanged) {
  NamedTensors ps = make_params({{3}, {4}}, 1);
  AdamW opt(ps);
  Generator gen(3);
  ps[0].second.set_grad(randn({3}, gen));
  ps[1].second.set_grad(randn({4}, gen, DType::f16));  // unsupported dtype
  Tensor p0 = ps[0].second.detach().clone();
  try {
    opt.step();
    FAIL() << "f16 gradient accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'p1'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(same_bits(p0, ps[0].second));
  EXPECT_EQ(opt.step_count(), 0);
  EXPECT_TRUE(opt.state_dict().tensors.empty());
}
