// The optimizer step one parameter at a time (Optimizer::step_parameter / end_step) and inside the
// backward (optim/in_backward.h): the bits of step() / clip_and_step's norm, gradients freed as
// they are used, parameters without a gradient left alone, and a gradient that arrives twice in
// one step refused.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "kiln/optim/adamw.h"
#include "kiln/optim/in_backward.h"
#include "kiln/optim/sgd.h"
#include "tests/expect.h"
#include "tests/optim/helpers.h"

using namespace kiln;
using namespace kiln::optim;
using namespace kiln::optim::test;
using kiln::test::error_of;
using kiln::test::same_bits;

namespace {

// A small model: loss = sum(y²), y = tanh(x p0) p1 + p2, plus sum(p3²) when `use_last` (else p3
// gets no gradient). Every parameter is used once.
Tensor model_loss(const NamedTensors& ps, const Tensor& x, bool use_last) {
  Tensor h = tanh(matmul(x, ps[0].second));
  Tensor y = add(matmul(h, ps[1].second), ps[2].second);
  Tensor loss = sum(mul(y, y));
  if (use_last) loss = add(loss, sum(mul(ps[3].second, ps[3].second)));
  return loss;
}

std::unique_ptr<Optimizer> make(const std::string& kind, const NamedTensors& ps) {
  if (kind == "adamw") {
    AdamWOptions o;
    o.lr = 3e-2;
    o.weight_decay = 0.1;
    o.decay = decay_matrices_only;
    return std::make_unique<AdamW>(ps, o);
  }
  SgdOptions o;
  o.lr = 5e-2;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  return std::make_unique<SGD>(ps, o);
}

}  // namespace

// step_parameter for every parameter, then end_step: step()'s bits, step counts and state.
TEST(OptimizerInBackward, StepParameterByParameterGivesTheStepsBits) {
  for (const std::string kind : {"adamw", "sgd"}) {
    SCOPED_TRACE(kind);
    const NamedTensors a = make_params({{5, 7}, {7, 3}, {3}, {2, 2}}, 11);
    const NamedTensors b = clone_params(a);
    auto oa = make(kind, a), ob = make(kind, b);
    Generator gen(5);
    for (int step = 0; step < 4; ++step) {
      const Tensor x = randn({6, 5}, gen);
      const bool use_last = step % 2 == 0;  // the last parameter has no gradient every other step
      model_loss(a, x, use_last).backward();
      model_loss(b, x, use_last).backward();
      oa->step();
      for (size_t i = 0; i < b.size(); ++i) ob->step_parameter(i);
      ob->end_step();
      oa->zero_grad();
      ob->zero_grad();
    }
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(b[i].second, a[i].second, a[i].first));
    EXPECT_EQ(ob->step_count(), oa->step_count());
    EXPECT_EQ(ob->state_dict().scalars.dump(), oa->state_dict().scalars.dump());
    const OptimizerState sa = oa->state_dict(), sb = ob->state_dict();
    ASSERT_EQ(sa.tensors.size(), sb.tensors.size());
    for (size_t i = 0; i < sa.tensors.size(); ++i)
      EXPECT_TRUE(same_bits(sb.tensors[i].second, sa.tensors[i].second, sa.tensors[i].first));
    EXPECT_NE(error_of([&] { ob->step_parameter(4); }).find("index 4 past the last of 4 parameters"),
              std::string::npos);
  }
}

// The hooks: each parameter updated in the backward and its gradient gone after it; the same
// bits as backward + clip_and_step(inf) (which measures the norm and clips nothing), the same norm.
TEST(OptimizerInBackward, UpdatesInTheBackwardGiveTheBitsOfAStepAfterIt) {
  const NamedTensors a = make_params({{5, 7}, {7, 3}, {3}, {2, 2}}, 21);
  const NamedTensors b = clone_params(a);
  // The optimizers list p3 (without a gradient at step 3) first, so that the norm's partials of
  // the others move when it has none.
  const auto p3_first = [](const NamedTensors& p) { return NamedTensors{p[3], p[0], p[1], p[2]}; };
  auto oa = make("adamw", p3_first(a)), ob = make("adamw", p3_first(b));
  OptimizerInBackward in_bwd(*ob);
  Generator gen(9);
  for (int step = 0; step < 5; ++step) {
    const Tensor x = randn({4, 5}, gen);
    const bool use_last = step != 2;
    model_loss(a, x, use_last).backward();
    const double norm_a = oa->clip_and_step(INFINITY);
    oa->zero_grad();
    in_bwd.begin_step();
    model_loss(b, x, use_last).backward();
    EXPECT_EQ(in_bwd.updated(), use_last ? 4 : 3);
    for (const auto& [name, p] : b) EXPECT_FALSE(p.grad().defined()) << name << ": its gradient was kept";
    const double norm_b = in_bwd.end_step();
    EXPECT_TRUE(same_bits(std::vector<double>{norm_b}, std::vector<double>{norm_a}, "the step's norm"));
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(b[i].second, a[i].second, a[i].first));
  EXPECT_EQ(ob->step_count(), 5);
  EXPECT_EQ(ob->state_dict().scalars.dump(), oa->state_dict().scalars.dump());
}

// A weight whose gradient arrives in two backward passes of one step would be updated with each
// part: the second arrival is an error naming it, and nothing is updated with it.
TEST(OptimizerInBackward, AGradientArrivingTwiceInAStepIsRefused) {
  const NamedTensors ps = make_params({{3, 3}, {3, 2}, {2}, {2, 2}}, 3);
  auto opt = make("sgd", ps);
  OptimizerInBackward in_bwd(*opt);
  Generator gen(1);
  const Tensor x = randn({2, 3}, gen);
  in_bwd.begin_step();
  model_loss(ps, x, true).backward();
  std::vector<Tensor> after_first;
  for (const auto& [n, p] : ps) after_first.push_back(p.detach().clone());
  // The first parameter the second backward reaches (p3's branch) is refused, before its update.
  const std::string e = error_of([&] { model_loss(ps, x, true).backward(); });
  EXPECT_NE(e.find("parameter 'p3' got a second gradient in one step"), std::string::npos) << e;
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(same_bits(ps[i].second, after_first[i], ps[i].first));
  // A new step takes gradients again.
  in_bwd.begin_step();
  for (const auto& [n, p] : ps) Tensor(p).set_grad(Tensor());
  model_loss(ps, x, true).backward();
  EXPECT_EQ(in_bwd.updated(), 4);
  EXPECT_TRUE(std::isfinite(in_bwd.end_step()));
}
