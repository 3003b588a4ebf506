// Optimizer state save/load: a run resumed from state_dict() (through a checkpoint-like round
// trip) continues bitwise identically to an uninterrupted one, for AdamW and SGD; loads that
// do not match (names, shapes, dtypes, kinds, decay groups) throw naming the entry and leave
// the optimizer unchanged.
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "helpers.h"
#include "kiln/optim/adamw.h"
#include "kiln/optim/schedule.h"
#include "kiln/optim/sgd.h"

using namespace kiln;
using namespace kiln::optim;
using namespace kiln::optim::test;
using namespace kiln::test;

namespace {

const std::vector<Shape> kShapes = {{1}, {7}, {129, 3}, {40000}};

using Factory = std::function<std::unique_ptr<Optimizer>(const NamedTensors&)>;

// Sets step s's gradients (a pure function of s: parameter 1 has none on step 4) and lr.
void prepare_step(Optimizer& opt, const NamedTensors& ps, int64_t s) {
  Generator gen(1000 + static_cast<uint64_t>(s));
  for (size_t i = 0; i < ps.size(); ++i) {
    Tensor p = ps[i].second;  // a handle: set_grad reaches the parameter
    Tensor g = randn(p.shape(), gen);
    p.set_grad(i == 1 && s == 4 ? Tensor() : g);
  }
  LrSchedule sched{ScheduleKind::cosine, 0.05, 0.005, 2, 6};
  opt.set_lr(sched.lr_at(opt.step_count()));
}

void expect_bitwise_resume(const Factory& make) {
  NamedTensors init = make_params(kShapes, 21);
  // Uninterrupted: 6 steps.
  NamedTensors a = clone_params(init);
  auto opt_a = make(a);
  for (int64_t s = 0; s < 6; ++s) {
    prepare_step(*opt_a, a, s);
    opt_a->step();
  }
  // Interrupted: 3 steps, save, load into a fresh optimizer over copies of the parameters, 3 more.
  NamedTensors b = clone_params(init);
  auto opt_b = make(b);
  for (int64_t s = 0; s < 3; ++s) {
    prepare_step(*opt_b, b, s);
    opt_b->step();
  }
  OptimizerState saved = checkpoint_round_trip(opt_b->state_dict());
  NamedTensors c = clone_params(b);
  auto opt_c = make(c);
  opt_c->set_lr(123.0);  // overwritten by the load
  opt_c->load_state_dict(saved);
  EXPECT_EQ(opt_c->step_count(), 3);
  EXPECT_EQ(opt_c->lr(), opt_b->lr());
  for (int64_t s = 3; s < 6; ++s) {
    prepare_step(*opt_c, c, s);
    opt_c->step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(a[i].second, c[i].second)) << a[i].first;
  OptimizerState sa = opt_a->state_dict(), sc = opt_c->state_dict();
  ASSERT_EQ(sa.tensors.size(), sc.tensors.size());
  for (size_t k = 0; k < sa.tensors.size(); ++k) {
    EXPECT_EQ(sa.tensors[k].first, sc.tensors[k].first);
    EXPECT_TRUE(same_bits(sa.tensors[k].second, sc.tensors[k].second)) << sa.tensors[k].first;
  }
  EXPECT_EQ(sa.scalars.dump(), sc.scalars.dump());
  // load_state_dict copies: an optimizer loaded straight from opt_b's live state and stepped
  // leaves opt_b's buffers as they were.
  NamedTensors d = clone_params(b);
  auto opt_d = make(d);
  opt_d->load_state_dict(opt_b->state_dict());
  prepare_step(*opt_d, d, 3);
  opt_d->step();
  OptimizerState again = opt_b->state_dict();
  ASSERT_EQ(again.tensors.size(), saved.tensors.size());
  for (size_t k = 0; k < again.tensors.size(); ++k)
    EXPECT_TRUE(same_bits(again.tensors[k].second, saved.tensors[k].second)) << again.tensors[k].first;
}

std::unique_ptr<Optimizer> make_adamw(const NamedTensors& ps) {
  AdamWOptions o;
  o.weight_decay = 0.1;
  o.decay = decay_matrices_only;
  return std::make_unique<AdamW>(ps, o);
}

std::unique_ptr<Optimizer> make_sgd(const NamedTensors& ps) {
  SgdOptions o;
  o.momentum = 0.9;
  o.dampening = 0.1;
  o.weight_decay = 0.01;
  return std::make_unique<SGD>(ps, o);
}

// Expects load_state_dict(s) to throw an error containing `needle`, and the optimizer's state
// to be what it was.
void expect_load_fails(Optimizer& opt, const OptimizerState& s, const std::string& needle) {
  const std::string before = opt.state_dict().scalars.dump();
  try {
    opt.load_state_dict(s);
    ADD_FAILURE() << "load accepted; expected an error with '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_EQ(opt.state_dict().scalars.dump(), before);
}

}  // namespace

TEST(OptimizerState, AdamWResumesBitwise) { expect_bitwise_resume(make_adamw); }
TEST(OptimizerState, SgdResumesBitwise) { expect_bitwise_resume(make_sgd); }
TEST(OptimizerState, NesterovSgdResumesBitwise) {
  expect_bitwise_resume([](const NamedTensors& ps) {
    SgdOptions o;
    o.momentum = 0.5;
    o.nesterov = true;
    return std::make_unique<SGD>(ps, o);
  });
}

TEST(OptimizerState, AdamWStateFormat) {
  NamedTensors ps = make_params({{2, 3}, {5}}, 3);
  auto opt = make_adamw(ps);
  ps[0].second.set_grad(ones({2, 3}));
  opt->set_lr(0.5);
  opt->step();
  OptimizerState s = opt->state_dict();
  ASSERT_EQ(s.tensors.size(), 2u);  // p1 had no gradient: no state
  EXPECT_EQ(s.tensors[0].first, "exp_avg.p0");
  EXPECT_EQ(s.tensors[1].first, "exp_avg_sq.p0");
  EXPECT_EQ(s.tensors[0].second.shape(), (Shape{2, 3}));
  EXPECT_EQ(s.tensors[0].second.dtype(), DType::f32);
  const json::Value& j = s.scalars;
  EXPECT_EQ(j.find("optimizer")->as_string(), "adamw");
  EXPECT_EQ(j.find("step")->as_int(), 1);
  EXPECT_EQ(j.find("lr")->as_double(), 0.5);
  EXPECT_EQ(j.find("beta1")->as_double(), 0.9);
  EXPECT_EQ(j.find("beta2")->as_double(), 0.999);
  EXPECT_EQ(j.find("eps")->as_double(), 1e-8);
  EXPECT_EQ(j.find("weight_decay")->as_double(), 0.1);
  ASSERT_EQ(j.find("no_decay")->size(), 1u);
  EXPECT_EQ(j.find("no_decay")->as_array()[0].as_string(), "p1");
  EXPECT_EQ(j.find("param_steps")->find("p0")->as_int(), 1);
  EXPECT_FALSE(j.find("param_steps")->contains("p1"));
}

TEST(OptimizerState, MismatchedLoadsThrowAndChangeNothing) {
  NamedTensors ps = make_params({{2, 3}, {5}}, 3);
  auto src = make_adamw(ps);
  Generator gen(4);
  ps[0].second.set_grad(randn({2, 3}, gen));
  ps[1].second.set_grad(randn({5}, gen));
  src->step();
  const OptimizerState good = checkpoint_round_trip(src->state_dict());

  NamedTensors qs = clone_params(ps);
  auto dst = make_adamw(qs);
  auto edit = [&](const std::function<void(OptimizerState&)>& f) {
    OptimizerState s = checkpoint_round_trip(good);
    f(s);
    return s;
  };
  // Wrong shape.
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.tensors[0].second = zeros({3, 2}); }),
                    "'exp_avg.p0' has shape [3, 2]");
  // Wrong dtype.
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.tensors[1].second = zeros({2, 3}, DType::f64); }),
                    "'exp_avg_sq.p0' has dtype f64");
  // Missing tensor.
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.tensors.erase(s.tensors.begin() + 3); }),
                    "missing tensor 'exp_avg_sq.p1'");
  // Unknown tensor name / parameter.
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.tensors.emplace_back("exp_avg.nope", zeros({1})); }),
                    "unexpected tensor 'exp_avg.nope'");
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.tensors.emplace_back("momentum_buffer.p0", zeros({2, 3})); }),
                    "unexpected tensor 'momentum_buffer.p0'");
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.scalars["param_steps"]["ghost"] = 1; }),
                    "'ghost', which is not a parameter");
  // Wrong optimizer kind.
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.scalars["optimizer"] = "sgd"; }),
                    "the state is of optimizer 'sgd'");
  // Different weight-decay groups.
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.scalars["no_decay"] = json::Value::array(); }),
                    "parameter 'p1' is exempt from weight decay here");
  // Bad hyper-parameters.
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.scalars["beta1"] = 1.5; }), "beta1=1.5");
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.scalars["lr"] = -1.0; }), "lr=-1");
  expect_load_fails(*dst, edit([](OptimizerState& s) { s.scalars = json::Value::object(); }), "no 'optimizer'");
  // Nothing changed: dst still steps like a fresh optimizer; the good state still loads.
  EXPECT_EQ(dst->step_count(), 0);
  EXPECT_TRUE(dst->state_dict().tensors.empty());
  EXPECT_NO_THROW(dst->load_state_dict(good));
  EXPECT_EQ(dst->step_count(), 1);

  // A state of another parameter set: fewer parameters, or more (from a probe: a state for p0, p1
  // loaded into an optimizer over p0, p1, p2 restored the step count while p2 started over).
  NamedTensors other = make_params({{2, 3}}, 3);
  auto small = make_adamw(other);
  expect_load_fails(*small, good, "the state is for parameter 'p1', which this optimizer does not have");
  NamedTensors more = make_params({{2, 3}, {5}, {4}}, 3);
  auto large = make_adamw(more);
  expect_load_fails(*large, good, "parameter 'p2' of this optimizer is not in the state (it was saved for 2");
  // SGD with and without momentum buffers do not mix.
  SgdOptions so;
  so.momentum = 0.9;
  SGD with_m(clone_params(ps), so);
  SGD without_m(clone_params(ps));
  NamedTensors sp = clone_params(ps);
  SGD stepped(sp, so);
  sp[0].second.set_grad(randn({2, 3}, gen));
  stepped.step();
  expect_load_fails(without_m, stepped.state_dict(), "unexpected tensor 'momentum_buffer.p0'");
  EXPECT_NO_THROW(with_m.load_state_dict(stepped.state_dict()));
}

TEST(OptimizerState, LoadsTensorsOfAnotherLayout) {
  // Tensors read from a file may come as non-contiguous views: they are copied in.
  NamedTensors ps = make_params({{4, 3}}, 8);
  AdamW a(ps);
  Generator gen(9);
  ps[0].second.set_grad(randn({4, 3}, gen));
  a.step();
  OptimizerState s = checkpoint_round_trip(a.state_dict());
  for (auto& [n, t] : s.tensors) t = t.t().contiguous().t();  // same values, transposed strides
  NamedTensors qs = clone_params(ps);
  AdamW b(qs);
  b.load_state_dict(s);
  Tensor g = randn({4, 3}, gen);
  ps[0].second.set_grad(g);
  qs[0].second.set_grad(g);
  a.step();
  b.step();
  EXPECT_TRUE(same_bits(ps[0].second, qs[0].second));
}
