// SGD vs a float64 implementation of torch.optim.SGD's formulas (momentum, dampening,
// Nesterov, weight decay, decay filter, skipped parameters), and its argument checks.
#include <gtest/gtest.h>

#include "helpers.h"
#include "kiln/optim/sgd.h"

using namespace kiln;
using namespace kiln::optim;
using namespace kiln::optim::test;
using namespace kiln::test;

namespace {

// torch.optim.SGD in float64 (maximize off).
struct RefSgd {
  double lr, momentum, dampening, wd;
  bool nesterov;
  std::vector<std::vector<double>> p, buf;
  std::vector<bool> decay;

  void step(size_t i, std::vector<double> d) {
    auto& P = p[i];
    const double w = decay[i] ? wd : 0.0;
    for (size_t k = 0; k < P.size(); ++k) {
      if (w != 0.0) d[k] += w * P[k];
    }
    if (momentum != 0.0) {
      if (buf[i].empty()) {
        buf[i] = d;
      } else {
        for (size_t k = 0; k < P.size(); ++k) buf[i][k] = momentum * buf[i][k] + (1.0 - dampening) * d[k];
      }
      for (size_t k = 0; k < P.size(); ++k) d[k] = nesterov ? d[k] + momentum * buf[i][k] : buf[i][k];
    }
    for (size_t k = 0; k < P.size(); ++k) P[k] -= lr * d[k];
  }
};

void run_case(const char* name, SgdOptions o, bool filter, DType grad_dtype = DType::f32) {
  SCOPED_TRACE(name);
  const std::vector<Shape> shapes = {{1}, {7}, {129}, {3, 5, 7}, {300, 129}};
  NamedTensors ps = make_params(shapes, 31);
  if (filter) o.decay = decay_matrices_only;
  SGD opt(ps, o);
  RefSgd ref{o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov, {}, {}, {}};
  for (size_t i = 0; i < ps.size(); ++i) {
    ref.p.push_back(as_f64(ps[i].second));
    ref.buf.emplace_back();
    ref.decay.push_back(!filter || shapes[i].size() >= 2);
  }
  Generator gen(7);
  for (int s = 0; s < 5; ++s) {
    const double lr = 0.1 / (1.0 + s);
    opt.set_lr(lr);
    ref.lr = lr;
    for (size_t i = 0; i < ps.size(); ++i) {
      if (i == 2 && (s == 0 || s == 2)) {  // skipped: no gradient
        ps[i].second.set_grad(Tensor());
        continue;
      }
      Tensor g = randn(shapes[i], gen, grad_dtype);
      ps[i].second.set_grad(g);
      ref.step(i, as_f64(g));
    }
    opt.step();
  }
  OptimizerState st = opt.state_dict();
  for (size_t i = 0; i < ps.size(); ++i) {
    const std::string& n = ps[i].first;
    EXPECT_TRUE(all_close(as_f64(ps[i].second), ref.p[i], finite_only({2e-6, 2e-6}), n));
    const Tensor* b = find_tensor(st, "momentum_buffer." + n);
    if (o.momentum == 0.0) {
      EXPECT_EQ(b, nullptr) << n;
    } else {
      ASSERT_NE(b, nullptr) << n;
      EXPECT_TRUE(all_close(as_f64(*b), ref.buf[i], finite_only({2e-6, 2e-6}), "momentum_buffer." + n));
    }
  }
}

}  // namespace

TEST(SGD, PlainMatchesFloat64Reference) { run_case("plain", SgdOptions{}, false); }
TEST(SGD, WeightDecayMatchesFloat64Reference) {
  SgdOptions o;
  o.weight_decay = 0.05;
  run_case("wd", o, true);
}
TEST(SGD, MomentumDampeningMatchesFloat64Reference) {
  SgdOptions o;
  o.momentum = 0.9;
  o.dampening = 0.3;
  o.weight_decay = 0.02;
  run_case("momentum", o, false);
}
TEST(SGD, NesterovMatchesFloat64Reference) {
  SgdOptions o;
  o.momentum = 0.8;
  o.nesterov = true;
  o.weight_decay = 0.02;
  run_case("nesterov", o, true, DType::bf16);
}

TEST(SGD, RejectsBadHyperparameters) {
  auto make = [](SgdOptions o) { SGD opt(make_params({{2}}, 1), o); };
  SgdOptions o;
  o.lr = -0.1;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.momentum = -0.5;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.weight_decay = -1;
  EXPECT_THROW(make(o), Error);
  o = {};
  o.nesterov = true;  // no momentum
  EXPECT_THROW(make(o), Error);
  o.momentum = 0.9;
  o.dampening = 0.1;  // nesterov needs dampening 0
  EXPECT_THROW(make(o), Error);
  o.dampening = 0.0;
  EXPECT_NO_THROW(make(o));
}
