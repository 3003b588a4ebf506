// The multi-tensor optimizer step (NOTE [multi-tensor step], kernels/optim.h) on the CPU:
// step() and clip_and_step() against the per-parameter path they replace (set_multi_tensor
// (false): one kernel per parameter, clip_grad_norm_ then step()) — bitwise with f32 gradients,
// clip active and inactive, every norm type, odd sizes (1, 7, 1000003), empty tensors, many
// tensors, parameters without gradients, non-contiguous parameters; bf16 gradients bitwise
// without a clip and within a stated bound with one; a float64 reference of the fused clip +
// AdamW; a non-finite norm skips the step and changes nothing; resume of a fused run's state;
// the same bits for 1 and 2 threads; bad arguments. Inputs are fresh random draws (the seed is
// printed on failure).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <random>

#include "helpers.h"
#include "kiln/optim/adamw.h"
#include "kiln/optim/clip.h"
#include "kiln/optim/sgd.h"

using namespace kiln;
using namespace kiln::optim;
using namespace kiln::optim::test;
using namespace kiln::test;

namespace {

uint64_t fresh_seed() { return std::random_device{}() | (uint64_t{std::random_device{}()} << 32); }

// Odd sizes, an empty tensor, matrices for the decay filter, and a parameter that is a
// transposed (non-contiguous) view.
std::vector<Shape> odd_shapes() { return {{1}, {7}, {1000003}, {0}, {129, 3}, {5, 0, 2}, {300, 129}, {17, 33}}; }

AdamWOptions adamw_options() {
  AdamWOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.8;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  o.decay = decay_matrices_only;
  return o;
}

// Gradients for one step of both twins (the same values, fresh storage each), drawn with
// scale `scale` so that the clip is active or not. Parameter `skip` gets none.
void set_grads(NamedTensors& a, NamedTensors& b, Generator& gen, DType gd, double scale, size_t skip) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (i == skip) {
      a[i].second.set_grad(Tensor());
      b[i].second.set_grad(Tensor());
      continue;
    }
    Tensor g = mul(randn(a[i].second.shape(), gen), scale).to(gd);
    a[i].second.set_grad(g.clone());
    b[i].second.set_grad(g.clone());
  }
}

void expect_same_state(const Optimizer& a, const Optimizer& b, const NamedTensors& pa, const NamedTensors& pb) {
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(same_bits(pa[i].second, pb[i].second)) << "parameter " << pa[i].first;
  OptimizerState sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.tensors.size(), sb.tensors.size());
  for (size_t k = 0; k < sa.tensors.size(); ++k) {
    EXPECT_EQ(sa.tensors[k].first, sb.tensors[k].first);
    EXPECT_TRUE(same_bits(sa.tensors[k].second, sb.tensors[k].second)) << sa.tensors[k].first;
  }
  EXPECT_EQ(sa.scalars.dump(), sb.scalars.dump());
}

// Bits of a double, for comparing norms exactly.
uint64_t bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// Runs `steps` steps of a multi-tensor optimizer and a per-parameter twin on the same
// gradients; clip < 0: step(), else clip_and_step(clip, norm_type) on the fused one and
// clip_grad_norm_ + step() (set_multi_tensor(false)) on the twin. Gradients are drawn at
// scales 0.1 and 10 in turn, so that a clip of 30 is inactive and active on alternate steps.
template <class Opt, class Options>
void compare_paths(const Options& o, const std::vector<Shape>& shapes, DType gd, double clip, double norm_type,
                   int steps, bool bitwise_after_clip = true) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  NamedTensors fused = make_params(shapes, seed), ref = clone_params(fused);
  Opt a(fused, o), b(ref, o);
  b.set_multi_tensor(false);
  ASSERT_TRUE(a.multi_tensor());
  Generator gen(seed + 1);
  for (int s = 0; s < steps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    a.set_lr(1e-2 * (1 + s));
    b.set_lr(1e-2 * (1 + s));
    set_grads(fused, ref, gen, gd, s % 2 ? 10.0 : 0.1, s == 2 ? 1 : shapes.size());
    if (clip < 0) {
      a.step();
      b.step();
      continue;
    }
    const double na = a.clip_and_step(clip, norm_type);
    const double nb = b.clip_and_step(clip, norm_type);  // clip_grad_norm_ + per-parameter step()
    EXPECT_EQ(bits(na), bits(nb)) << na << " vs " << nb;
    EXPECT_EQ(bits(na), bits(clip_grad_norm_(fused, INFINITY, {norm_type}))) << "the gradients were changed";
  }
  if (bitwise_after_clip) expect_same_state(a, b, fused, ref);
  EXPECT_EQ(a.step_count(), steps);
}

}  // namespace

TEST(MultiTensor, AdamWStepIsBitwiseThePerParameterStep) {
  compare_paths<AdamW>(adamw_options(), odd_shapes(), DType::f32, -1, 2.0, 5);
}

TEST(MultiTensor, AdamWFusedClipIsBitwiseClipGradNormThenStep) {
  // Gradients at scale 0.1 and 10 in turn. odd_shapes (~1.1e6 elements): 2-norms ~105 and
  // ~1.05e4. small (~10^4 elements): 1-norms ~800 and ~8e4, max norms ~0.4 and ~40, 3-norms
  // ~2.6 and ~260. Each max_norm below clips on every step, on none, or on the odd steps only.
  const std::vector<Shape> shapes = odd_shapes();
  const std::vector<Shape> small = {{1}, {7}, {0}, {129, 3}, {9973}};
  compare_paths<AdamW>(adamw_options(), shapes, DType::f32, 30.0, 2.0, 4);      // every step
  compare_paths<AdamW>(adamw_options(), shapes, DType::f32, 1e5, 2.0, 3);       // none
  compare_paths<AdamW>(adamw_options(), shapes, DType::f32, 500.0, 2.0, 4);     // odd steps
  compare_paths<AdamW>(adamw_options(), small, DType::f32, 1e4, 1.0, 4);        // odd steps
  compare_paths<AdamW>(adamw_options(), small, DType::f32, 3.0, INFINITY, 4);   // odd steps
  compare_paths<AdamW>(adamw_options(), small, DType::f32, 30.0, 3.0, 4);       // odd steps
  compare_paths<AdamW>(adamw_options(), small, DType::f32, INFINITY, 2.0, 3);   // measures only
}

TEST(MultiTensor, ManySmallTensors) {
  std::vector<Shape> shapes;
  for (int i = 0; i < 700; ++i) shapes.push_back({1 + (i * 37) % 301});
  compare_paths<AdamW>(adamw_options(), shapes, DType::f32, 5.0, 2.0, 3);
  SgdOptions o;
  o.momentum = 0.9;
  compare_paths<SGD>(o, shapes, DType::f32, 5.0, 2.0, 3);
}

TEST(MultiTensor, SgdIsBitwiseThePerParameterPath) {
  SgdOptions plain;
  plain.lr = 0.05;
  SgdOptions mom = plain;
  mom.momentum = 0.9;
  mom.dampening = 0.1;
  mom.weight_decay = 0.01;
  SgdOptions nest = plain;
  nest.momentum = 0.8;
  nest.nesterov = true;
  nest.decay = decay_matrices_only;
  nest.weight_decay = 0.02;
  const std::vector<Shape> small = {{1}, {7}, {0}, {129, 3}, {9973}};
  for (const SgdOptions& o : {plain, mom, nest}) {
    compare_paths<SGD>(o, small, DType::f32, -1, 2.0, 4);
    compare_paths<SGD>(o, small, DType::f32, 50.0, 2.0, 4);  // 2-norms ~10 and ~1000: odd steps
    compare_paths<SGD>(o, small, DType::bf16, -1, 2.0, 3);
  }
  compare_paths<SGD>(mom, odd_shapes(), DType::f32, 500.0, 2.0, 4);
}

TEST(MultiTensor, Bf16GradientsBitwiseWithoutClipAndBoundedWithIt) {
  compare_paths<AdamW>(adamw_options(), odd_shapes(), DType::bf16, -1, 2.0, 4);
  compare_paths<AdamW>(adamw_options(), odd_shapes(), DType::bf16, 1e5, 2.0, 3);  // inactive: bitwise
  // Active: clip_grad_norm_ rounds g * scale to bf16 before the update, the fused step keeps it
  // in f32. The norm is the same bits (computed from the same bf16 gradients); the parameters
  // differ by what a relative change of 2^-9 in one step's gradient moves AdamW's update: the
  // update is lr * m_hat / (sqrt(v_hat) + eps) with |update| <= lr / (1 - beta1) ~ 5 lr, and a
  // relative change d of g changes it by at most ~ 2 d (1 - beta1)/(1 - beta1^t) of its size in a
  // step; with lr <= 0.04 over 3 steps that is far below 1e-3 absolute. The test checks 1e-3.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<Shape> shapes = odd_shapes();
  NamedTensors fused = make_params(shapes, seed), ref = clone_params(fused);
  AdamW a(fused, adamw_options()), b(ref, adamw_options());
  b.set_multi_tensor(false);
  Generator gen(seed + 1);
  bool differed = false;
  for (int s = 0; s < 3; ++s) {
    a.set_lr(1e-2 * (1 + s));
    b.set_lr(1e-2 * (1 + s));
    set_grads(fused, ref, gen, DType::bf16, 1.0, shapes.size());
    EXPECT_EQ(bits(a.clip_and_step(10.0)), bits(b.clip_and_step(10.0)));
  }
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_TRUE(all_close(as_f64(fused[i].second), as_f64(ref[i].second), finite_only({1e-3, 0}), fused[i].first));
    differed = differed || !same_bits(fused[i].second, ref[i].second);
  }
  // Not one rounding apart anywhere would mean the fused step rounded to bf16 as well.
  EXPECT_TRUE(differed) << "the fused bf16 step gave clip_grad_norm_'s bits: is the scale applied before rounding?";
}

TEST(MultiTensor, FusedClipMatchesFloat64Reference) {
  // The fused clip + AdamW against float64: the norm of the gradients, the coefficient
  // max_norm / (norm + 1e-6), then torch's AdamW on the scaled gradients.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<Shape> shapes = {{1}, {7}, {1000003}, {0}, {129, 3}};
  NamedTensors ps = make_params(shapes, seed);
  AdamWOptions o = adamw_options();
  o.decay = nullptr;
  AdamW opt(ps, o);
  std::vector<std::vector<double>> p, m, v;
  for (const auto& [n, t] : ps) {
    p.push_back(as_f64(t));
    m.emplace_back(p.back().size(), 0.0);
    v.emplace_back(p.back().size(), 0.0);
  }
  Generator gen(seed + 1);
  const double max_norm = 50.0;
  for (int s = 1; s <= 4; ++s) {
    std::vector<std::vector<double>> g;
    double sq = 0;
    for (auto& [n, t] : ps) {
      Tensor gt = randn(t.shape(), gen);
      t.set_grad(gt);
      g.push_back(as_f64(gt));
      for (double x : g.back()) sq += x * x;
    }
    const double norm = std::sqrt(sq);
    const double got = opt.clip_and_step(max_norm);
    EXPECT_NEAR(got, norm, 1e-12 * norm);
    const double coef = std::min(1.0, max_norm / (norm + 1e-6));
    ASSERT_LT(coef, 1.0);  // ~1000 sqrt(1.1) >> 50: the clip acts
    const double bc1 = 1 - std::pow(o.beta1, s), bc2 = 1 - std::pow(o.beta2, s);
    for (size_t i = 0; i < p.size(); ++i)
      for (size_t k = 0; k < p[i].size(); ++k) {
        const double gk = g[i][k] * coef;
        p[i][k] *= 1 - o.lr * o.weight_decay;
        m[i][k] = o.beta1 * m[i][k] + (1 - o.beta1) * gk;
        v[i][k] = o.beta2 * v[i][k] + (1 - o.beta2) * gk * gk;
        p[i][k] -= o.lr / bc1 * m[i][k] / (std::sqrt(v[i][k]) / std::sqrt(bc2) + o.eps);
      }
  }
  OptimizerState st = opt.state_dict();
  for (size_t i = 0; i < ps.size(); ++i) {
    const std::string& n = ps[i].first;
    // Parameters of order 1 move by about lr per step; f32 rounding (and the f32 coefficient)
    // stays far below.
    EXPECT_TRUE(all_close(as_f64(ps[i].second), p[i], finite_only({2e-6, 2e-6}), n));
    if (ps[i].second.numel() == 0) continue;
    EXPECT_TRUE(all_close(as_f64(*find_tensor(st, "exp_avg." + n)), m[i], finite_only({1e-7, 1e-5}), "exp_avg." + n));
    EXPECT_TRUE(
        all_close(as_f64(*find_tensor(st, "exp_avg_sq." + n)), v[i], finite_only({1e-9, 1e-5}), "exp_avg_sq." + n));
  }
}

TEST(MultiTensor, NonFiniteNormSkipsTheStepAndChangesNothing) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<Shape> shapes = {{7}, {1000003}, {129, 3}};
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), double{INFINITY}}) {
    for (const double max_norm : {1.0, double{INFINITY}}) {
      NamedTensors fused = make_params(shapes, seed), ref = clone_params(fused);
      AdamW a(fused, adamw_options()), b(ref, adamw_options());
      Generator gen(seed + 1);
      set_grads(fused, ref, gen, DType::f32, 1.0, shapes.size());
      a.clip_and_step(max_norm);
      b.clip_and_step(max_norm);
      // A bad gradient element in the big tensor: the fused step must skip everything.
      set_grads(fused, ref, gen, DType::f32, 1.0, shapes.size());
      Tensor g = fused[1].second.grad();
      g.narrow(0, 777777, 1).fill_(bad);
      Tensor g_before = g.clone();
      const double n = a.clip_and_step(max_norm);
      EXPECT_FALSE(std::isfinite(n)) << n;
      EXPECT_TRUE(same_bits(g, g_before)) << "gradients changed";
      EXPECT_EQ(a.step_count(), 1);
      expect_same_state(a, b, fused, ref);  // b never saw the bad step
      // The next good step continues as if the bad one never came.
      set_grads(fused, ref, gen, DType::f32, 1.0, shapes.size());
      EXPECT_EQ(bits(a.clip_and_step(max_norm)), bits(b.clip_and_step(max_norm)));
      expect_same_state(a, b, fused, ref);
    }
  }
}

TEST(MultiTensor, ResumesFromAFusedRunsStateBitwise) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<Shape> shapes = odd_shapes();
  NamedTensors full = make_params(shapes, seed), first = clone_params(full);
  AdamW a(full, adamw_options()), b(first, adamw_options());
  Generator ga(seed + 1), gb(seed + 1);
  auto grads = [&](NamedTensors& ps, Generator& gen, int s) {
    for (size_t i = 0; i < ps.size(); ++i)
      ps[i].second.set_grad(s == 1 && i == 2 ? Tensor() : mul(randn(ps[i].second.shape(), gen), 3.0));
  };
  for (int s = 0; s < 3; ++s) {
    grads(full, ga, s);
    a.clip_and_step(100.0);
    grads(first, gb, s);
    b.clip_and_step(100.0);
  }
  // Resume into a fresh optimizer over copies of the parameters (one on the per-parameter path:
  // both paths keep the same state).
  OptimizerState saved = checkpoint_round_trip(b.state_dict());
  for (bool multi : {true, false}) {
    NamedTensors resumed = clone_params(first);
    AdamW c(resumed, adamw_options());
    c.set_multi_tensor(multi);
    c.load_state_dict(saved);
    NamedTensors cont = clone_params(full);
    AdamW d(cont, adamw_options());
    d.load_state_dict(checkpoint_round_trip(a.state_dict()));
    Generator gc(seed + 7), gd(seed + 7);
    for (int s = 3; s < 5; ++s) {
      grads(resumed, gc, s);
      grads(cont, gd, s);
      EXPECT_EQ(bits(c.clip_and_step(100.0)), bits(d.clip_and_step(100.0)));
    }
    expect_same_state(c, d, resumed, cont);
    EXPECT_EQ(c.step_count(), 5);
  }
}

TEST(MultiTensor, NonContiguousParametersAndGradients) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto make = [&](NamedTensors& ps) {
    Generator gen(seed);
    Tensor p = randn({40, 30}, gen).transpose(0, 1);  // a non-contiguous leaf view
    p.requires_grad_();
    ps.emplace_back("t", p);
    Tensor q = randn({1000003}, gen);
    q.requires_grad_();
    ps.emplace_back("q", q);
  };
  NamedTensors a, b;
  make(a);
  make(b);
  ASSERT_FALSE(a[0].second.is_contiguous());
  AdamW oa(a, adamw_options()), ob(b, adamw_options());
  ob.set_multi_tensor(false);
  Generator gg(seed + 3);
  for (int s = 0; s < 3; ++s) {
    Tensor gt = randn({40, 30}, gg).transpose(0, 1);  // a non-contiguous gradient
    Tensor gq = randn({1000003}, gg);
    a[0].second.set_grad(gt);
    b[0].second.set_grad(gt.transpose(0, 1).clone().transpose(0, 1));
    a[1].second.set_grad(gq.clone());
    b[1].second.set_grad(gq.clone());
    ASSERT_FALSE(a[0].second.grad().is_contiguous());
    ASSERT_FALSE(b[0].second.grad().is_contiguous());
    EXPECT_EQ(bits(oa.clip_and_step(20.0)), bits(ob.clip_and_step(20.0)));
  }
  EXPECT_TRUE(same_bits(a[0].second.contiguous(), b[0].second.contiguous()));
  expect_same_state(oa, ob, a, b);
}

TEST(MultiTensor, SameBitsForOneAndTwoThreads) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int before = omp_get_max_threads();
  NamedTensors one = make_params(odd_shapes(), seed), two = clone_params(one);
  AdamW a(one, adamw_options()), b(two, adamw_options());
  Generator gen(seed + 1);
  for (int s = 0; s < 3; ++s) {
    set_grads(one, two, gen, DType::f32, 1.0, 99);
    omp_set_num_threads(1);
    const double na = a.clip_and_step(100.0);
    omp_set_num_threads(2);
    const double nb = b.clip_and_step(100.0);
    EXPECT_EQ(bits(na), bits(nb));
  }
  omp_set_num_threads(before);
  expect_same_state(a, b, one, two);
}

TEST(MultiTensor, NoGradientsBadArgumentsAndBadGradients) {
  NamedTensors ps = make_params({{7}, {3, 4}}, fresh_seed());
  AdamW opt(ps, adamw_options());
  EXPECT_EQ(opt.clip_and_step(1.0), 0.0);  // no gradients: norm 0, a step counted (as step())
  EXPECT_EQ(opt.step_count(), 1);
  for (double bad : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    try {
      opt.clip_and_step(bad);
      ADD_FAILURE() << "max_norm " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_norm="), std::string::npos) << e.what();
    }
  }
  for (double bad : {0.0, -2.0, std::numeric_limits<double>::quiet_NaN()}) {
    try {
      opt.clip_and_step(1.0, bad);
      ADD_FAILURE() << "norm_type " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("norm_type="), std::string::npos) << e.what();
    }
  }
  // A bad gradient after a good one: nothing is touched, not even the good one's parameter.
  Tensor before0 = ps[0].second.detach().clone(), before1 = ps[1].second.detach().clone();
  Generator gen(3);
  ps[0].second.set_grad(randn({7}, gen));
  ps[1].second.set_grad(zeros({3, 4}, DType::f16));
  try {
    opt.clip_and_step(1.0);
    ADD_FAILURE() << "an f16 gradient was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has dtype f16"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(same_bits(before0, ps[0].second));
  EXPECT_TRUE(same_bits(before1, ps[1].second));
  EXPECT_EQ(opt.step_count(), 1);
}

TEST(MultiTensor, StepWithAGivenNormIsClipAndStep) {
  // FSDP computes the norm over every rank's shards itself; step_with_norm then clips by it
  // inside the update. Given clip_grad_norm_'s norm it must give clip_and_step's bits, on both
  // paths.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<Shape> shapes = {{1}, {7}, {0}, {129, 3}, {100003}};
  NamedTensors pa = make_params(shapes, seed), pb = clone_params(pa), pc = clone_params(pa);
  AdamW a(pa, adamw_options()), b(pb, adamw_options()), c(pc, adamw_options());
  c.set_multi_tensor(false);
  Generator gen(seed + 1);
  for (int s = 0; s < 4; ++s) {
    set_grads(pa, pb, gen, DType::f32, s % 2 ? 10.0 : 0.1, s == 2 ? 1 : shapes.size());
    for (size_t i = 0; i < pc.size(); ++i)
      pc[i].second.set_grad(pa[i].second.grad().defined() ? pa[i].second.grad().clone() : Tensor());
    const double max_norm = 5.0;  // 2-norms ~3 and ~300: the odd steps clip
    const double n = a.clip_and_step(max_norm);
    std::vector<Tensor> tb;
    for (const auto& [name, p] : pb) tb.push_back(p);
    EXPECT_EQ(bits(grad_norm(tb)), bits(n));
    EXPECT_TRUE(b.step_with_norm(n, max_norm));
    EXPECT_TRUE(c.step_with_norm(n, max_norm));
  }
  expect_same_state(a, b, pa, pb);
  expect_same_state(a, c, pa, pc);
  // A non-finite norm skips the step on both paths.
  set_grads(pa, pb, gen, DType::f32, 1.0, shapes.size());
  Tensor before = pb[4].second.detach().clone();
  EXPECT_FALSE(b.step_with_norm(std::numeric_limits<double>::quiet_NaN(), 1.0));
  EXPECT_FALSE(b.step_with_norm(INFINITY, 1.0));
  EXPECT_TRUE(same_bits(before, pb[4].second));
  EXPECT_EQ(b.step_count(), 4);
  for (const double bad : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_THROW(b.step_with_norm(1.0, bad), Error);
  }
  EXPECT_THROW(b.step_with_norm(-1.0, 1.0), Error);
  EXPECT_EQ(b.step_count(), 4);
}
