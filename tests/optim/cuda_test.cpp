// The optimizer kernels on a GPU: AdamW, SGD and clip_grad_norm_ on CUDA tensors agree with
// the CPU bodies (same math; the GPU may fuse multiply-adds, so within a few ulps), are
// bitwise reproducible run to run, and a CUDA optimizer resumes from a CPU-held state
// bitwise. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include "helpers.h"
#include "kiln/optim/adamw.h"
#include "kiln/optim/clip.h"
#include "kiln/optim/sgd.h"

using namespace kiln;
using namespace kiln::optim;
using namespace kiln::optim::testing;

namespace {

#define KILN_REQUIRE_CUDA() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"

const std::vector<Shape> kShapes = {{1}, {7}, {129, 3}, {70000}};

NamedTensors on_device(const NamedTensors& ps, Device d) {
  NamedTensors out;
  for (const auto& [n, p] : ps) {
    Tensor c = p.detach().to(d).clone();
    c.requires_grad_();
    out.emplace_back(n, c);
  }
  return out;
}

// Runs 4 steps of `opt` over `ps` with gradients (dtype gd) from a fixed generator.
void run(Optimizer& opt, const NamedTensors& ps, DType gd) {
  Generator gen(77);
  for (int s = 0; s < 4; ++s) {
    for (const auto& [n, p] : ps) {
      Tensor h = p;
      h.set_grad(randn(p.shape(), gen, gd).to(p.device()));
    }
    opt.set_lr(0.01 * (s + 1));
    opt.step();
  }
}

template <class Opt, class Options>
void compare_devices(const Options& o, DType gd) {
  NamedTensors init = make_params(kShapes, 5);
  NamedTensors c = on_device(init, kCPU), g1 = on_device(init, cuda(0)), g2 = on_device(init, cuda(0));
  Opt oc(c, o), og1(g1, o), og2(g2, o);
  run(oc, c, gd);
  run(og1, g1, gd);
  run(og2, g2, gd);
  for (size_t i = 0; i < c.size(); ++i) {
    expect_close(as_f64(g1[i].second), as_f64(c[i].second), 1e-6, 1e-6, "cuda vs cpu " + c[i].first);
    EXPECT_TRUE(same_bits(g1[i].second, g2[i].second)) << "cuda run to run " << c[i].first;
  }
  OptimizerState sc = oc.state_dict(), sg = og1.state_dict();
  ASSERT_EQ(sc.tensors.size(), sg.tensors.size());
  for (size_t k = 0; k < sc.tensors.size(); ++k) {
    EXPECT_TRUE(sg.tensors[k].second.is_cuda());
    expect_close(as_f64(sg.tensors[k].second), as_f64(sc.tensors[k].second), 1e-6, 1e-5, sc.tensors[k].first);
  }
}

}  // namespace

TEST(OptimCuda, AdamWMatchesCpu) {
  KILN_REQUIRE_CUDA();
  AdamWOptions o;
  o.weight_decay = 0.1;
  o.decay = decay_matrices_only;
  compare_devices<AdamW>(o, DType::f32);
  compare_devices<AdamW>(o, DType::bf16);
}

TEST(OptimCuda, SgdMatchesCpu) {
  KILN_REQUIRE_CUDA();
  SgdOptions o;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 0.01;
  compare_devices<SGD>(o, DType::f32);
}

TEST(OptimCuda, ResumesFromCpuStateBitwise) {
  KILN_REQUIRE_CUDA();
  NamedTensors init = make_params(kShapes, 6);
  NamedTensors a = on_device(init, cuda(0)), b = on_device(init, cuda(0));
  AdamW oa(a), ob(b);
  run(oa, a, DType::f32);
  run(ob, b, DType::f32);
  // b's state goes through the host (as a checkpoint does) into a fresh CUDA optimizer.
  OptimizerState s = ob.state_dict();
  for (auto& [n, t] : s.tensors) t = t.to(kCPU);
  NamedTensors c = on_device(b, cuda(0));
  AdamW oc(c);
  oc.load_state_dict(checkpoint_round_trip(s));
  run(oa, a, DType::f32);
  run(oc, c, DType::f32);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(a[i].second, c[i].second)) << a[i].first;
}

TEST(OptimCuda, ClipGradNormMatchesCpu) {
  KILN_REQUIRE_CUDA();
  NamedTensors init = make_params(kShapes, 8);
  NamedTensors c = on_device(init, kCPU), g = on_device(init, cuda(0));
  Generator gen(9);
  for (size_t i = 0; i < c.size(); ++i) {
    Tensor grad = randn(kShapes[i], gen);
    c[i].second.set_grad(grad);
    g[i].second.set_grad(grad.to(cuda(0)));
  }
  for (double p : {2.0, 1.0, static_cast<double>(INFINITY)}) {
    ClipGradOptions o;
    o.norm_type = p;
    const double nc = grad_norm({c[0].second, c[1].second, c[2].second, c[3].second}, p);
    const double ng = grad_norm({g[0].second, g[1].second, g[2].second, g[3].second}, p);
    EXPECT_NEAR(ng, nc, 1e-12 * nc) << p;
    EXPECT_EQ(ng, grad_norm({g[0].second, g[1].second, g[2].second, g[3].second}, p)) << "run to run";
  }
  const double nc = clip_grad_norm_(c, 1.0), ng = clip_grad_norm_(g, 1.0);
  EXPECT_NEAR(ng, nc, 1e-12 * nc);
  for (size_t i = 0; i < c.size(); ++i)
    expect_close(as_f64(g[i].second.grad()), as_f64(c[i].second.grad()), 0, 1e-6, "clipped " + c[i].first);
}
