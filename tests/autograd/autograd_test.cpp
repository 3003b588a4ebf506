// Tests of the autograd engine: diamond graphs, a tensor used twice, accumulation across
// backward calls, NoGradGuard, detach, retain_graph, version checks on saved tensors, in-place
// rules, requires_grad rules, non-scalar backward, and gradients of views.
#include <cmath>
#include <string_view>
#include <thread>

#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/backward.h"
#include "kiln/optim/clip.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {
std::vector<double> vals(const Tensor& t) { return t.to_vector<double>(); }
}  // namespace

TEST(Autograd, DiamondGraph) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    Tensor x = randn({5}, gen, DType::f64, dev).requires_grad_();
    Tensor a = x * 2.0, b = exp(x);
    Tensor y = sum(a * b);  // d/dx = 2 e^x + 2x e^x
    y.backward();
    auto xv = vals(x), g = vals(x.grad());
    for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(g[i], 2 * std::exp(xv[i]) * (1 + xv[i]), 1e-12);
  }
}

TEST(Autograd, TensorUsedTwiceAndThroughSeveralPaths) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    Tensor x = randn({4}, gen, DType::f64, dev).requires_grad_();
    sum(x * x + x).backward();  // 2x + 1
    auto xv = vals(x), g = vals(x.grad());
    for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(g[i], 2 * xv[i] + 1, 1e-12);
    // Multiple outputs of one op (split), one of them unused.
    Tensor z = randn({6}, gen, DType::f64, dev).requires_grad_();
    auto parts = split(z, 2, 0);
    sum(parts[0] * 3.0 + parts[2]).backward();
    EXPECT_EQ(vals(z.grad()), (std::vector<double>{3, 3, 0, 0, 1, 1}));
  }
}

TEST(Autograd, GradientsAccumulateAcrossBackwardCalls) {
  for (Device dev : test_devices()) {
    Tensor x = from_vector(std::vector<double>{1, 2, 3}, {3}, dev).requires_grad_();
    sum(x * x).backward();
    EXPECT_EQ(vals(x.grad()), (std::vector<double>{2, 4, 6}));
    sum(x * 3.0).backward();
    EXPECT_EQ(vals(x.grad()), (std::vector<double>{5, 7, 9}));
    x.set_grad(Tensor());
    sum(x).backward();
    EXPECT_EQ(vals(x.grad()), (std::vector<double>{1, 1, 1}));
  }
}

// set_grad takes only a gradient of the tensor's shape, dtype and device, and stores an expanded
// view as a copy: clip_grad_norm_ scaled the one stored element of a 4-filled expand twice.
TEST(Autograd, SetGradChecksAndCopiesExpandedViews) {
  Tensor a = zeros({2}).requires_grad_();
  EXPECT_THROW(a.set_grad(ones({2}, DType::i64)), Error);
  EXPECT_THROW(a.set_grad(ones({3})), Error);
  a.set_grad(full({1}, 4.0).expand({2}));
  EXPECT_NEAR(optim::clip_grad_norm_(std::vector<Tensor>{a}, 1.0), std::sqrt(32.0), 1e-5);
  for (double g : vals(a.grad())) EXPECT_NEAR(g, 1 / std::sqrt(2.0), 1e-5);
}

// copy_ records no history: a source in a graph is an error in grad mode (its gradient was lost
// silently: w.grad came out [1, 1] where PyTorch gives [4, 4]); detached, or under NoGradGuard,
// it copies.
TEST(Autograd, CopyFromAGraphIsAnError) {
  Tensor w = from_vector<double>({1, 2}, {2}).requires_grad_();
  Tensor buf = zeros({2}, DType::f64);
  EXPECT_KILN_ERROR(buf.copy_(mul(w, 3.0)), "copy_", "source requires grad");
  buf.copy_(mul(w, 3.0).detach());
  EXPECT_EQ(buf.to_vector<double>(), (std::vector<double>{3, 6}));
  NoGradGuard ng;
  buf.copy_(w);
  EXPECT_EQ(buf.to_vector<double>(), (std::vector<double>{1, 2}));
}

TEST(Autograd, NoGradGuardAndDetach) {
  Tensor x = ones({3}).requires_grad_();
  {
    NoGradGuard ng;
    EXPECT_FALSE(grad_enabled());
    Tensor y = x * 2.0;
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(y.is_leaf());
    {
      NoGradGuard inner;
    }
    EXPECT_FALSE(grad_enabled());  // the inner guard restores "off"
  }
  EXPECT_TRUE(grad_enabled());
  Tensor d = x.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.storage(), x.storage());
  // A detached path contributes no gradient.
  sum(x * d + x).backward();
  EXPECT_EQ(vals(x.grad()), (std::vector<double>{2, 2, 2}));
  Tensor m = mul(x, 2.0);
  EXPECT_TRUE(m.requires_grad());
  EXPECT_FALSE(m.is_leaf());
  EXPECT_NE(m.grad_fn(), nullptr);
}

TEST(Autograd, RetainGraph) {
  Tensor x = full({2}, 3.0, DType::f64).requires_grad_();
  Tensor y = sum(exp(x));
  y.backward(Tensor(), true);
  y.backward(Tensor(), true);
  EXPECT_NEAR(vals(x.grad())[0], 2 * std::exp(3.0), 1e-12);
  y.backward();  // frees the graph
  EXPECT_KILN_ERROR(y.backward(), "retain_graph", "second time");
}

TEST(Autograd, InPlaceOnSavedTensorFailsAtBackward) {
  Tensor a = full({3}, 2.0);
  Tensor w = ones({3}).requires_grad_();
  Tensor y = sum(a * w);  // saves a
  a.fill_(5.0);
  EXPECT_KILN_ERROR(y.backward(), "modified by an in-place operation", "mul");
  // Not saved: in-place on an input whose value backward does not need is fine.
  Tensor b = full({3}, 2.0);
  Tensor w2 = ones({3}).requires_grad_();
  Tensor y2 = sum(b + w2);
  b.fill_(7.0);
  y2.backward();
  EXPECT_EQ(vals(w2.grad()), (std::vector<double>{1, 1, 1}));
}

TEST(Autograd, InPlaceRules) {
  Tensor leaf = zeros({3}).requires_grad_();
  EXPECT_KILN_ERROR(leaf.fill_(1.0), "fill_", "leaf", "requires grad");
  EXPECT_KILN_ERROR(add_(leaf, ones({3})), "add_", "leaf");
  EXPECT_KILN_ERROR(leaf.copy_(ones({3})), "copy_", "leaf");
  Tensor mid = leaf * 2.0;
  EXPECT_KILN_ERROR(mul_(mid, 2.0), "mul_", "autograd graph");
  {
    NoGradGuard ng;  // optimizer-style update
    add_(leaf, ones({3}), -0.5);
  }
  EXPECT_EQ(vals(leaf), (std::vector<double>{-0.5, -0.5, -0.5}));
}

TEST(Autograd, RequiresGradAndBackwardArguments) {
  Tensor i = zeros({3}, DType::i64);
  EXPECT_KILN_ERROR(i.requires_grad_(), "requires_grad", "floating", "i64");
  Tensor x = ones({2, 3}).requires_grad_();
  Tensor y = x * 2.0;
  EXPECT_KILN_ERROR(y.backward(), "backward", "scalar", "[2, 3]");
  EXPECT_KILN_ERROR(y.backward(ones({3})), "backward: gradient 0 has shape [3]", "[2, 3]");
  EXPECT_KILN_ERROR(y.backward(ones({2, 3}, DType::f64)), "backward", "f64");
  EXPECT_KILN_ERROR(zeros({}).backward(), "backward", "does not require grad");
  EXPECT_KILN_ERROR(y.requires_grad_(false), "requires_grad_", "non-leaf");
  // run_backward checks every root's gradient the same way (ops read them laid out like their
  // outputs), naming which one is wrong.
  Tensor z = x * 3.0;
  EXPECT_KILN_ERROR(run_backward({y, z}, {ones({2, 3}), ones({3, 2})}, false), "backward: gradient 1 has shape [3, 2]");
  EXPECT_KILN_ERROR(run_backward({y, z}, {ones({2, 3}), ones({2, 3}, DType::bf16)}, false), "gradient 1 has dtype bf16");
  EXPECT_KILN_ERROR(run_backward({y}, {Tensor()}, false), "backward: gradient 0 is undefined");
  // A non-scalar output with an explicit gradient.
  y.backward(full({2, 3}, 0.5));
  EXPECT_EQ(vals(x.grad()), std::vector<double>(6, 1.0));
}

TEST(Autograd, GradientsOfViewsScatter) {
  for (Device dev : test_devices()) {
    auto leaf = [&](Shape s) { return arange(0, static_cast<double>(shape_numel(s)), 1, DType::f64, dev).view(s).detach().requires_grad_(); };
    Tensor x = leaf({3, 4});
    sum(x.slice(1, 1, 4, 2) * 10.0).backward();
    EXPECT_EQ(vals(x.grad()), (std::vector<double>{0, 10, 0, 10, 0, 10, 0, 10, 0, 10, 0, 10}));
    Tensor s = leaf({3, 4});
    sum(s.select(0, 1) * s.select(1, 0).select(0, 1)).backward();  // s[1,:] * s[1,0]
    // d/ds[1,j] = s[1,0] for j != 0; d/ds[1,0] = s[1,0] + sum(s[1,:])
    EXPECT_EQ(vals(s.grad()), (std::vector<double>{0, 0, 0, 0, 4 + 22, 4, 4, 4, 0, 0, 0, 0}));
    Tensor e = leaf({3, 1});
    sum(e.expand({2, 3, 5})).backward();
    EXPECT_EQ(vals(e.grad()), (std::vector<double>{10, 10, 10}));
    Tensor p = leaf({2, 3});
    Tensor w = arange(0, 6, 1, DType::f64, dev).view({3, 2});
    sum(p.permute({1, 0}) * w).backward();  // grad p[i,j] = w[j,i]
    EXPECT_EQ(vals(p.grad()), (std::vector<double>{0, 2, 4, 1, 3, 5}));
    Tensor t = leaf({2, 3});
    sum(t.t().reshape({6}) * arange(0, 6, 1, DType::f64, dev)).backward();  // t.t() flat order: t[0,0], t[1,0], t[0,1], ...
    EXPECT_EQ(vals(t.grad()), (std::vector<double>{0, 2, 4, 1, 3, 5}));
  }
}

// (From a probe of the engine.) Each of these failed without its fix.
TEST(Autograd, DeepGraphsSavedIndicesAndInPlaceSources) {
  // A 300 000-op chain: freeing its graph recursed once per node (a segfault at ~200 000 on an
  // 8 MB stack, backward or not).
  {
    Tensor x = full({1}, 1.0, DType::f64).requires_grad_();
    Tensor y = x;
    for (int i = 0; i < 300000; ++i) y = mul(y, 1.0);
    sum(y).backward();
    EXPECT_EQ(x.grad().item(), 1.0);
  }
  {
    Tensor x = full({1}, 1.0, DType::f64).requires_grad_();
    Tensor y = x;
    for (int i = 0; i < 300000; ++i) y = mul(y, 1.0);
  }  // freed without a backward
  // Nodes reached twice: a residual chain (y + f(y), a transformer's shape) and y * y; freeing
  // them recursed once per node until the edges that are not the last hold were dropped first.
  {
    Tensor x = full({1}, 1.0, DType::f64).requires_grad_();
    Tensor y = x, z = x;
    for (int i = 0; i < 150000; ++i) {
      y = add(mul(y, 1.0), y);
      z = mul(z, z);
    }
  }
  // add_ records no history: a source that requires grad lost its gradient (w.grad [1, 2, 3]
  // where PyTorch gives [2, 4, 6]); as copy_, it is an error.
  Tensor w = arange(1, 4, 1, DType::f64).requires_grad_();
  Tensor buf = zeros({3}, DType::f64);
  EXPECT_KILN_ERROR(add_(buf, w), "add_", "source requires grad");
  add_(buf, w.detach());
  // max's indices are saved with their version: refilled, the gradient went elsewhere.
  Tensor x = from_vector(std::vector<double>{1, 5, 3, 7, 2, 0}, {2, 3}).requires_grad_();
  ValuesIndices vi = max(x, 1);
  vi.indices.fill_(0);
  EXPECT_KILN_ERROR(sum(vi.values).backward(), "max backward", "modified by an in-place operation");
  // rotary_embedding's fused path saves its tables with their versions (cos.fill_(0) gave dx 0).
  auto [c, sn] = rotary_tables(2, 4, 10000.0);
  Tensor q = ones({1, 1, 2, 4}).requires_grad_();
  Tensor r = rotary_embedding(q, c, sn);
  c.fill_(0);
  EXPECT_KILN_ERROR(sum(r).backward(), "rotary_embedding backward", "modified by an in-place operation");
  // A .grad of another dtype accumulates in the wider one ("add: dtype mismatch" from inside
  // backward): bf16 on an f32 leaf, and f32 on a bf16 leaf, where 1 + 1/512 needs f32.
  Tensor p = ones({2}).requires_grad_();
  p.set_grad(full({2}, 1.0, DType::bf16));
  sum(mul(p, 3.0)).backward();
  EXPECT_EQ(p.grad().dtype(), DType::bf16);
  EXPECT_EQ(vals(p.grad()), (std::vector<double>{4, 4}));
  Tensor pb = ones({2}, DType::bf16).requires_grad_();
  pb.set_grad(full({2}, 1.0, DType::f32));
  sum(mul(pb, 1.0 / 512)).backward();
  EXPECT_EQ(pb.grad().dtype(), DType::f32);
  EXPECT_EQ(vals(pb.grad()), (std::vector<double>{1 + 1.0 / 512, 1 + 1.0 / 512}));
  // The root that needs no gradient is named by its index (it said element 0).
  Tensor a = ones({1}).requires_grad_(), none = ones({1});
  EXPECT_KILN_ERROR(run_backward({mul(a, 2.0), none}, {ones({1}), ones({1})}, false), "element 1 of tensors");
}

// Two threads build graphs on one leaf and run their backwards at once: the accumulator's lazy
// creation and the accumulation are guarded by the leaf's lock (it aborted with "pure virtual
// method called" in 3 of 3 runs; PyTorch supports this).
TEST(Autograd, ConcurrentBackwardsShareALeaf) {
  Tensor w = zeros({64}, DType::f64).requires_grad_();
  auto work = [&] {
    for (int i = 0; i < 1000; ++i) sum(mul(w, 1.0)).backward();
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  for (double g : vals(w.grad())) ASSERT_EQ(g, 2000.0);
}

// Unary ops save only what their gradient reads, as PyTorch's: add_scalar, mul_scalar and neg
// save nothing (an in-place write to their input failed the backward, and every op kept both
// its input and its output alive), exp keeps its output, log its input.
TEST(Autograd, OpsSaveOnlyWhatTheirGradientReads) {
  Tensor w = ones({3}, DType::f64).requires_grad_();
  Tensor y = add(mul(neg(w), 2.0), 1.0);
  {
    NoGradGuard ng;
    w.fill_(5);
  }
  sum(y).backward();
  EXPECT_EQ(vals(w.grad()), (std::vector<double>{-2, -2, -2}));
  Tensor x = ones({3}, DType::f64).requires_grad_();
  Tensor e = exp(x), l = log(x);
  {
    NoGradGuard ng;
    e.fill_(2);
  }
  EXPECT_KILN_ERROR(sum(e).backward(), "exp backward", "modified by an in-place operation");
  {
    NoGradGuard ng;
    x.fill_(2);
  }
  EXPECT_KILN_ERROR(sum(l).backward(), "log backward", "modified by an in-place operation");
}

TEST(Autograd, ProductsSaveOnlyTheSideTheOtherGradientReads) {
  // y = a * b and a / b with only a requiring grad: b is saved, a is not (its memory is not kept
  // for the backward), as in PyTorch; with only b requiring grad ("... b"), a product saves a and
  // not b. b's side of a division reads a and b: both saved.
  for (std::string_view op : {"mul", "mul b", "div", "div b"}) {
    SCOPED_TRACE(op);
    const bool division = op.starts_with("div"), b_side = op.ends_with(" b");
    Tensor leaf = full({3}, 2.0, DType::f64).requires_grad_();
    Tensor a = b_side ? full({3}, 3.0, DType::f64) : mul(leaf, 1.0);
    Tensor b = b_side ? mul(leaf, 1.0) : full({3}, 4.0, DType::f64);
    auto a_storage = a.storage(), b_storage = b.storage();
    Tensor y = division ? div(a, b) : mul(a, b);
    a = Tensor(), b = Tensor();
    EXPECT_EQ(a_storage.use_count(), b_side ? 2 : 1);  // here and in y's saved tensors, or here only
    EXPECT_EQ(b_storage.use_count(), b_side && !division ? 1 : 2);
    sum(y).backward();
    const double expected = b_side ? (division ? -3.0 / 4.0 : 3.0) : division ? 0.25 : 4.0;
    EXPECT_EQ(vals(leaf.grad()), (std::vector<double>(3, expected)));
  }
}

TEST(Autograd, ALeafThatStopsRequiringGradGetsNoGradient) {
  Tensor w = ones({3}, DType::f64).requires_grad_(), v = ones({3}, DType::f64).requires_grad_();
  Tensor y = sum(add(mul(w, 2.0), mul(v, 3.0)));
  w.requires_grad_(false);  // after the graph was built: PyTorch's AccumulateGrad then skips it
  y.backward();
  EXPECT_FALSE(w.grad().defined());
  EXPECT_EQ(vals(v.grad()), (std::vector<double>{3, 3, 3}));
}
