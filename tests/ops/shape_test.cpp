// Tests of the shape ops: cat/split/stack and every view op (view, reshape incl. of
// non-contiguous inputs, flatten, slice with step, narrow, select, transpose, permute, expand,
// squeeze/unsqueeze): values against index arithmetic, gradients through the harness, and
// bad-input errors.
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {
Tensor iota(Shape s, Device dev = kCPU) { return arange(0, static_cast<double>(shape_numel(s)), 1, DType::f64, dev).view(s); }
std::vector<double> vals(const Tensor& t) { return t.to_vector<double>(); }
}  // namespace

TEST(Views, ValuesFollowIndexArithmetic) {
  for (Device dev : test_devices()) {
    Tensor x = iota({3, 4, 5}, dev);  // x[i,j,k] = 20i + 5j + k
    Tensor s = x.slice(2, 1, 5, 2);
    ASSERT_EQ(s.shape(), (Shape{3, 4, 2}));
    auto sv = vals(s);
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t k = 0; k < 2; ++k) EXPECT_EQ(sv[static_cast<size_t>((i * 4 + j) * 2 + k)], 20 * i + 5 * j + 1 + 2 * k);
    EXPECT_EQ(x.slice(0, -2, 3).shape(), (Shape{2, 4, 5}));
    EXPECT_EQ(x.slice(1, 0, 100, 3).shape(), (Shape{3, 2, 5}));
    EXPECT_EQ(vals(x.select(1, -1).select(0, 2)), (std::vector<double>{55, 56, 57, 58, 59}));
    EXPECT_EQ(vals(x.narrow(2, 3, 2).select(0, 0).select(0, 0)), (std::vector<double>{3, 4}));
    Tensor p = x.permute({2, 0, 1});
    ASSERT_EQ(p.shape(), (Shape{5, 3, 4}));
    auto pv = vals(p);
    for (int64_t k = 0; k < 5; ++k)
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(pv[static_cast<size_t>((k * 3 + i) * 4 + j)], 20 * i + 5 * j + k);
    EXPECT_EQ(vals(x.transpose(0, -1).select(0, 1).select(0, 2)), (std::vector<double>{11, 31, 51}));
    Tensor e = iota({3, 1}, dev).expand({2, 3, 4});
    EXPECT_EQ(e.shape(), (Shape{2, 3, 4}));
    EXPECT_EQ(e.stride(0), 0);
    auto ev = vals(e);
    for (size_t i = 0; i < ev.size(); ++i) EXPECT_EQ(ev[i], static_cast<double>((i / 4) % 3));
    EXPECT_EQ(iota({3, 1}, dev).expand({-1, 2}).shape(), (Shape{3, 2}));
    EXPECT_EQ(x.unsqueeze(1).shape(), (Shape{3, 1, 4, 5}));
    EXPECT_EQ(x.unsqueeze(-1).shape(), (Shape{3, 4, 5, 1}));
    EXPECT_EQ(x.unsqueeze(0).squeeze(0).shape(), (Shape{3, 4, 5}));
    EXPECT_EQ(x.squeeze(1).shape(), (Shape{3, 4, 5}));  // size 4: unchanged
    EXPECT_EQ(x.flatten(1).shape(), (Shape{3, 20}));
    EXPECT_EQ(x.flatten().shape(), (Shape{60}));
    // reshape of a non-contiguous tensor copies, and its values are the permuted order.
    Tensor t = x.transpose(0, 2);
    Tensor r = t.reshape({5, 12});
    EXPECT_NE(r.storage(), x.storage());
    EXPECT_EQ(vals(r), vals(t.contiguous()));
    EXPECT_EQ(x.reshape({-1, 5}).storage(), x.storage());
    EXPECT_EQ(x.view({4, 15}).storage(), x.storage());
  }
}

TEST(Views, GradientsScatterThroughTheHarness) {
  auto one = [](std::function<Tensor(const Tensor&)> f) { return [f](const std::vector<Tensor>& v) { return f(v[0]); }; };
  check_op({"slice step", {{{4, 7}}}, one([](const Tensor& x) { return x.slice(1, 1, 7, 2); })});
  check_op({"slice neg", {{{4, 7}}}, one([](const Tensor& x) { return x.slice(0, -3, -1); })});
  check_op({"select", {{{4, 7}}}, one([](const Tensor& x) { return x.select(1, 3); })});
  check_op({"narrow", {{{3, 7, 2}}}, one([](const Tensor& x) { return x.narrow(1, 2, 4); })});
  check_op({"expand", {{{3, 1}}}, one([](const Tensor& x) { return x.expand({2, 3, 5}); })});
  check_op({"permute", {{{2, 3, 4}}}, one([](const Tensor& x) { return x.permute({1, 2, 0}); })});
  check_op({"transpose", {{{2, 3, 4}}}, one([](const Tensor& x) { return x.transpose(0, 2); })});
  check_op({"squeeze", {{{3, 1, 4}}}, one([](const Tensor& x) { return x.squeeze(1); })});
  check_op({"unsqueeze", {{{3, 4}}}, one([](const Tensor& x) { return x.unsqueeze(1); })});
  check_op({"reshape", {{{3, 4}}}, one([](const Tensor& x) { return x.t().reshape({2, 6}); })});
  check_op({"view", {{{3, 4}}}, one([](const Tensor& x) { return x.contiguous().view({4, 3}); })});
  check_op({"flatten", {{{2, 3, 4}}}, one([](const Tensor& x) { return x.flatten(0, 1); })});
  // Overlapping views used together: both gradients land in the same input.
  check_op({"two slices", {{{7}}}, one([](const Tensor& x) { return x.slice(0, 0, 5) * x.slice(0, 2, 7); })});
}

TEST(CatSplitStack, ValuesAndGradients) {
  for (Device dev : test_devices()) {
    Tensor a = iota({2, 3}, dev), b = add(iota({2, 1}, dev), 100.0);
    Tensor c = cat({a, b}, 1);
    EXPECT_EQ(vals(c), (std::vector<double>{0, 1, 2, 100, 3, 4, 5, 101}));
    EXPECT_EQ(cat({a, a}, -2).shape(), (Shape{4, 3}));
    Tensor s = stack({a, a, a}, 1);
    EXPECT_EQ(s.shape(), (Shape{2, 3, 3}));
    EXPECT_EQ(vals(s.select(1, 2)), vals(a));
    auto parts = split(iota({7, 2}, dev), 3, 0);
    ASSERT_EQ(parts.size(), 3u);
    EXPECT_EQ(parts[2].shape(), (Shape{1, 2}));
    EXPECT_EQ(vals(parts[1]), (std::vector<double>{6, 7, 8, 9, 10, 11}));
    auto p2 = split(iota({2, 6}, dev), std::vector<int64_t>{1, 5}, -1);
    EXPECT_EQ(vals(p2[0]), (std::vector<double>{0, 6}));
    EXPECT_EQ(p2[1].shape(), (Shape{2, 5}));
  }
  check_op({"cat", {{{2, 3}}, {{2, 1}}, {{2, 4}}}, [](const std::vector<Tensor>& v) { return cat(v, 1); }});
  check_op({"stack", {{{3}}, {{3}}}, [](const std::vector<Tensor>& v) { return stack(v, 0); }});
  check_op({"split", {{{7, 2}}}, [](const std::vector<Tensor>& v) {
              auto p = split(v[0], 3, 0);
              return cat({p[2], p[0]}, 0);
            }});
}

// narrow takes start in [-size, size] as torch, a negative one counted from the end (it was
// refused); past that range it stays an error.
TEST(Views, NarrowWrapsNegativeStart) {
  for (Device dev : test_devices()) {
    Tensor x = iota({2, 5}, dev);
    Tensor y = x.narrow(1, -2, 2);
    ASSERT_EQ(y.shape(), (Shape{2, 2}));
    EXPECT_EQ(vals(y), (std::vector<double>{3, 4, 8, 9}));
    EXPECT_EQ(vals(x.narrow(-1, -5, 1)), (std::vector<double>{0, 5}));
    EXPECT_EQ(x.narrow(1, -5, 5).shape(), (Shape{2, 5}));
    EXPECT_EQ(x.narrow(1, 5, 0).shape(), (Shape{2, 0}));
    Tensor g = x.detach().requires_grad_();
    sum(g.narrow(1, -2, 2)).backward();
    EXPECT_EQ(vals(g.grad()), (std::vector<double>{0, 0, 0, 1, 1, 0, 0, 0, 1, 1}));
    EXPECT_KILN_ERROR(x.narrow(1, -6, 1), "narrow", "start -6", "[-5, 5]");
    EXPECT_KILN_ERROR(x.narrow(1, -2, 3), "narrow", "start -2 (3 from the front) + length 3", "exceeds size 5");
    EXPECT_KILN_ERROR(x.narrow(1, 6, 0), "narrow", "start 6");
    EXPECT_KILN_ERROR(x.narrow(1, -1, -1), "narrow", "length -1");
    EXPECT_KILN_ERROR(x.narrow(1, INT64_MIN, 1), "narrow", "out of range");
  }
}

TEST(ShapeErrors, NameOpAndValues) {
  Tensor x = zeros({2, 3});
  EXPECT_KILN_ERROR(x.view({4, 2}), "view", "[4, 2]", "6");
  EXPECT_KILN_ERROR(x.t().view({6}), "view", "reshape");
  EXPECT_KILN_ERROR(x.reshape({-1, -1}), "reshape", "-1");
  EXPECT_KILN_ERROR(x.slice(2, 0, 1), "slice", "dim 2");
  EXPECT_KILN_ERROR(x.slice(0, 0, 1, 0), "slice", "step", "0");
  EXPECT_KILN_ERROR(x.select(1, 3), "select", "index 3", "size 3");
  EXPECT_KILN_ERROR(x.narrow(1, 2, 2), "narrow", "exceeds");
  // Overflow in the bounds (from a probe): a huge narrow start passed as an empty view, a huge
  // slice step gave a size of -1, a negative expand size other than -1 went into the shape.
  EXPECT_KILN_ERROR(x.narrow(1, INT64_MAX, 1), "narrow", "out of range");
  EXPECT_EQ(x.slice(1, 0, 3, INT64_MAX).shape(), (Shape{2, 1}));
  EXPECT_KILN_ERROR(zeros({2, 1}).expand({2, -2}), "expand", "size -2", "negative");
  EXPECT_KILN_ERROR(x.permute({0, 0}), "permute", "repeated");
  EXPECT_KILN_ERROR(x.permute({0}), "permute", "1 dims");
  EXPECT_KILN_ERROR(x.expand({4, 3}), "expand", "(2)", "4");
  EXPECT_KILN_ERROR(x.unsqueeze(4), "unsqueeze", "dim 4");
  EXPECT_KILN_ERROR(cat({x, zeros({2, 4})}, 0), "cat", "[2, 4]", "outside dim 0");
  EXPECT_KILN_ERROR(cat({x, zeros({2, 3}, DType::f16)}, 0), "cat", "f16");
  EXPECT_KILN_ERROR(cat({}, 0), "cat", "at least one");
  EXPECT_KILN_ERROR(stack({x, zeros({3, 2})}, 0), "stack");
  EXPECT_KILN_ERROR(split(x, std::vector<int64_t>{1, 1}, 1), "split");
  EXPECT_KILN_ERROR(split(x, 0, 1), "split");
}

// Dims as PyTorch takes them (from a probe of the ops against PyTorch): a 0-d tensor takes dim 0
// and -1 in reductions, softmax, max, squeeze and transpose (each refused it), t() leaves 0-d
// and 1-d tensors as they are and refuses more than 2 dims (3-d swapped dims 0 and 1), split of
// an empty dim gives one empty part (it gave none), softmax over an empty dim an empty result
// (amax refused it), and stack names itself (the message named unsqueeze).
TEST(ShapeErrors, DimsAsPyTorchTakesThem) {
  Tensor s = full({}, 3.0);
  EXPECT_EQ(sum(s, {0}).item(), 3.0);
  EXPECT_EQ(sum(s, {-1}, true).shape(), Shape{});
  EXPECT_EQ(amax(s, {0}).item(), 3.0);
  EXPECT_EQ(softmax(s, 0).item(), 1.0);
  EXPECT_EQ(log_softmax(s, -1).item(), 0.0);
  ValuesIndices m = max(s, 0);
  EXPECT_EQ(m.values.shape(), Shape{});
  EXPECT_EQ(m.values.item(), 3.0);
  EXPECT_EQ(m.indices.item(), 0.0);
  EXPECT_EQ(s.squeeze(0).shape(), Shape{});
  EXPECT_EQ(s.transpose(0, -1).item(), 3.0);
  EXPECT_KILN_ERROR(sum(s, {1}), "sum", "dim 1", "rank 0", "-1 to 0");
  EXPECT_KILN_ERROR(sum(s, {0, -1}), "sum", "given twice");
  EXPECT_KILN_ERROR(s.select(0, 0), "select", "0-d");
  EXPECT_KILN_ERROR(s.size(0), "size", "0-d");

  Tensor v = arange(4, DType::f32);
  EXPECT_EQ(v.t().shape(), (Shape{4}));
  EXPECT_EQ(v.t().data_ptr(), v.data_ptr());
  EXPECT_EQ(s.t().item(), 3.0);
  EXPECT_EQ(zeros({2, 3}).t().shape(), (Shape{3, 2}));
  EXPECT_KILN_ERROR(zeros({2, 3, 4}).t(), "t:", "[2, 3, 4]", "transpose");

  std::vector<Tensor> parts = split(zeros({0, 3}), 2, 0);
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].shape(), (Shape{0, 3}));
  EXPECT_EQ(split(zeros({5}), INT64_MAX, 0).size(), 1u);  // the part count did not overflow

  EXPECT_EQ(softmax(zeros({3, 0}), 1).shape(), (Shape{3, 0}));
  EXPECT_EQ(log_softmax(zeros({0, 4}), 0).shape(), (Shape{0, 4}));
  EXPECT_KILN_ERROR(softmax(zeros({3, 0}), 2), "softmax", "dim 2");

  EXPECT_KILN_ERROR(stack({zeros({2}), zeros({2})}, 3), "stack", "dim 3", "rank 2");
  EXPECT_KILN_ERROR(split(zeros({2}), 1, 1), "split", "dim 1");
}
