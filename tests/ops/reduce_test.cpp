// Tests of the reductions (sum, mean, amax, max, argmax with dims, keepdim, negative dims,
// ties) and softmax/log_softmax: harness runs plus independent float64 loop references,
// and bad-input errors.
#include <cmath>

#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {

// Loop reference: reduce x [a, b, c] (f64, contiguous) over the dims in `red` with f.
std::vector<double> reduce3(const std::vector<double>& x, Shape s, std::vector<int64_t> red, bool is_max, bool is_mean) {
  std::vector<bool> r(3, false);
  for (auto d : red) r[static_cast<size_t>(d < 0 ? d + 3 : d)] = true;
  if (red.empty()) r = {true, true, true};
  Shape o;
  for (int i = 0; i < 3; ++i) o.push_back(r[i] ? 1 : s[i]);
  std::vector<double> out(static_cast<size_t>(o[0] * o[1] * o[2]), is_max ? -INFINITY : 0.0);
  std::vector<int64_t> cnt(out.size(), 0);
  for (int64_t i = 0; i < s[0]; ++i)
    for (int64_t j = 0; j < s[1]; ++j)
      for (int64_t k = 0; k < s[2]; ++k) {
        size_t oi = static_cast<size_t>(((r[0] ? 0 : i) * o[1] + (r[1] ? 0 : j)) * o[2] + (r[2] ? 0 : k));
        double v = x[static_cast<size_t>((i * s[1] + j) * s[2] + k)];
        out[oi] = is_max ? std::max(out[oi], v) : out[oi] + v;
        cnt[oi]++;
      }
  if (is_mean)
    for (size_t i = 0; i < out.size(); ++i) out[i] /= static_cast<double>(cnt[i]);
  return out;
}

}  // namespace

TEST(Reduce, SumMeanAmaxMatchLoopsForEveryDimSet) {
  KILN_TEST_GENERATOR(gen);
  const Shape s{3, 7, 5};
  std::vector<std::vector<int64_t>> dimsets{{}, {0}, {1}, {2}, {-1}, {0, 2}, {-3, -2}, {0, 1, 2}};
  for (Device dev : test_devices()) {
    Tensor x = randn(s, gen, DType::f64, dev);
    auto xv = x.to_vector<double>();
    for (const auto& dims : dimsets) {
      for (bool keep : {false, true}) {
        Tensor ys = sum(x, dims, keep), ym = mean(x, dims, keep), ya = amax(x, dims, keep);
        auto rs = reduce3(xv, s, dims, false, false), rm = reduce3(xv, s, dims, false, true),
             ra = reduce3(xv, s, dims, true, false);
        // Shapes.
        Shape expect;
        for (int64_t d = 0; d < 3; ++d) {
          bool reduced = dims.empty();
          for (auto q : dims) reduced |= (q < 0 ? q + 3 : q) == d;
          if (!reduced) expect.push_back(s[static_cast<size_t>(d)]);
          else if (keep) expect.push_back(1);
        }
        EXPECT_EQ(ys.shape(), expect);
        EXPECT_EQ(ym.shape(), expect);
        EXPECT_EQ(ya.shape(), expect);
        EXPECT_TRUE(all_close(ys, from_vector(rs, expect), {1e-12, 1e-12}, "sum"));
        EXPECT_TRUE(all_close(ym, from_vector(rm, expect), {1e-12, 1e-12}, "mean"));
        EXPECT_TRUE(all_close(ya, from_vector(ra, expect), {0, 0}, "amax"));
      }
    }
  }
}

TEST(Reduce, Harness) {
  for (auto dims : std::vector<std::vector<int64_t>>{{}, {0}, {-1}, {0, 2}}) {
    for (bool keep : {false, true}) {
      check_op({"sum", {{{3, 7, 5}}}, [=](const std::vector<Tensor>& v) { return sum(v[0], dims, keep); },
                {DType::f64, DType::f32, DType::f16, DType::bf16}, true, true, 4.0});
      check_op({"mean", {{{3, 7, 5}}}, [=](const std::vector<Tensor>& v) { return mean(v[0], dims, keep); }});
      check_op({"amax", {{{3, 7, 5}}}, [=](const std::vector<Tensor>& v) { return amax(v[0], dims, keep); }});
    }
  }
  check_op({"sum 129", {{{129}}}, [](const std::vector<Tensor>& v) { return sum(v[0]); },
            {DType::f64, DType::f32, DType::f16, DType::bf16}, true, true, 8.0});
  check_op({"max values", {{{4, 7}}}, [](const std::vector<Tensor>& v) { return max(v[0], -1).values; }});
  check_op({"max values dim0 keepdim", {{{4, 7}}}, [](const std::vector<Tensor>& v) { return max(v[0], 0, true).values; }});
}

TEST(Reduce, MaxArgmaxTiesTakeTheFirstIndex) {
  for (Device dev : test_devices()) {
    Tensor x = from_vector(std::vector<float>{1, 3, 3, 0, 5, 5, 5, 5, -1, -2, -1, -3}, {3, 4}, dev);
    auto mv = max(x, 1);
    EXPECT_EQ(mv.values.to_vector<float>(), (std::vector<float>{3, 5, -1}));
    EXPECT_EQ(mv.indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 0}));
    EXPECT_EQ(mv.indices.dtype(), DType::i64);
    EXPECT_EQ(argmax(x, -1).to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 0}));
    EXPECT_EQ(argmax(x, 0, true).shape(), (Shape{1, 4}));
    EXPECT_EQ(argmax(x, 0).to_vector<int64_t>(), (std::vector<int64_t>{1, 1, 1, 1}));
    // max's gradient goes to the first maximum only; amax shares it among ties.
    Tensor a = x.to(DType::f64).requires_grad_();
    sum(max(a, 1).values).backward();
    EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0}));
    Tensor b = x.to(DType::f64).requires_grad_();
    sum(amax(b, {1})).backward();
    EXPECT_EQ(b.grad().to_vector<double>(), (std::vector<double>{0, .5, .5, 0, .25, .25, .25, .25, .5, 0, .5, 0}));
  }
}

TEST(Reduce, IntegerSum) {
  for (Device dev : test_devices()) {
    Tensor x = arange(0, 12, 1, DType::i64, dev).view({3, 4});
    EXPECT_EQ(sum(x, {1}).to_vector<int64_t>(), (std::vector<int64_t>{6, 22, 38}));
    EXPECT_EQ(sum(x.t(), {-1}).to_vector<int64_t>(), (std::vector<int64_t>{12, 15, 18, 21}));
    // Narrower integers and bool sum into i64, as in PyTorch (they wrapped in their own dtype).
    const Tensor big = from_vector(std::vector<int32_t>{INT32_MAX, INT32_MAX, 2}, {3}).to(dev);
    EXPECT_EQ(sum(big).dtype(), DType::i64);
    EXPECT_EQ(sum(big).item(), 2.0 * INT32_MAX + 2);
    const Tensor flags = lt(arange(0, 300, 1, DType::f32, dev), full({}, 290.0, DType::f32, dev));
    EXPECT_EQ(sum(flags).dtype(), DType::i64);
    EXPECT_EQ(sum(flags).item(), 290.0);
    EXPECT_EQ(sum(full({2, 200}, 1.0, DType::u8, dev), {1}).to_vector<int64_t>(), (std::vector<int64_t>{200, 200}));
  }
}

// 16-bit mean, softmax and log_softmax compute in f32 and round once, as PyTorch (rounded to
// f16 the sums overflowed: a mean of inf, a softmax of 0, a log_softmax of -inf; bf16 rows
// summed to 0.9956), forward and backward.
TEST(Softmax, SixteenBitInputsComputeInF32) {
  for (Device dev : test_devices()) {
    SCOPED_TRACE(dev.str());
    EXPECT_EQ(mean(full({100}, 1000.0, DType::f16, dev)).item(), 1000.0);
    const double n = 70000;
    const std::vector<float> sm = softmax(zeros({70000}, DType::f16, dev), 0).to(DType::f32).to_vector<float>();
    EXPECT_NEAR(sm[0], 1 / n, 0.01 / n);
    const std::vector<float> lsm = log_softmax(zeros({70000}, DType::f16, dev), 0).to(DType::f32).to_vector<float>();
    EXPECT_NEAR(lsm[9], -std::log(n), 0.01);
    const Tensor expect = full({1}, 1.0 / 3000, DType::bf16);  // 1/3000 rounded once
    EXPECT_EQ(softmax(zeros({3000}, DType::bf16, dev), 0).to(DType::f32).to_vector<float>()[5], expect.item());
    Tensor x = zeros({70000}, DType::f16, dev).requires_grad_();
    // A constant upstream gradient: 0 up to the rounding of the saved f16 output (its sum is not
    // exactly 1).
    sum(mul(softmax(x, 0), full({70000}, 2.0, DType::f16, dev))).backward();
    for (double gv : x.grad().to(DType::f64).to_vector<double>()) ASSERT_LE(std::abs(gv), 1e-6);
  }
}

TEST(Softmax, MatchesLoopsAndHarness) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    Tensor x = mul(randn({3, 7}, gen, DType::f64, dev), 4.0);
    auto xv = x.to_vector<double>();
    for (int64_t dim : {1, -1, 0}) {
      auto sv = softmax(x, dim).to_vector<double>(), lv = log_softmax(x, dim).to_vector<double>();
      int64_t d = dim < 0 ? dim + 2 : dim;
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t j = 0; j < 7; ++j) {
          double m = -INFINITY, z = 0;
          int64_t n = d == 1 ? 7 : 3;
          auto at = [&](int64_t k) { return d == 1 ? xv[static_cast<size_t>(i * 7 + k)] : xv[static_cast<size_t>(k * 7 + j)]; };
          for (int64_t k = 0; k < n; ++k) m = std::max(m, at(k));
          for (int64_t k = 0; k < n; ++k) z += std::exp(at(k) - m);
          double v = xv[static_cast<size_t>(i * 7 + j)];
          EXPECT_NEAR(sv[static_cast<size_t>(i * 7 + j)], std::exp(v - m) / z, 1e-14);
          EXPECT_NEAR(lv[static_cast<size_t>(i * 7 + j)], v - m - std::log(z), 1e-12);
        }
    }
    // Large logits do not overflow.
    Tensor big = from_vector(std::vector<float>{1000, 1000, -1000}, {3}, dev);
    auto bs = softmax(big, 0).to_vector<float>();
    EXPECT_FLOAT_EQ(bs[0], 0.5f);
    EXPECT_FLOAT_EQ(bs[2], 0.0f);
  }
  for (int64_t dim : {-1, 0}) {
    check_op({"softmax", {{{4, 7}}}, [dim](const std::vector<Tensor>& v) { return softmax(v[0], dim); }});
    check_op({"log_softmax", {{{4, 7}}}, [dim](const std::vector<Tensor>& v) { return log_softmax(v[0], dim); }});
  }
  check_op({"softmax 129", {{{2, 129}}}, [](const std::vector<Tensor>& v) { return softmax(v[0], 1); }});
  check_op({"log_softmax 1", {{{5, 1}}}, [](const std::vector<Tensor>& v) { return log_softmax(v[0], 1); }});
}

TEST(ReduceErrors, NameOpAndValues) {
  Tensor x = zeros({2, 3});
  EXPECT_KILN_ERROR(sum(x, {2}), "sum", "dim 2", "rank 2");
  EXPECT_KILN_ERROR(sum(x, {-3}), "sum", "dim -3");
  EXPECT_KILN_ERROR(sum(x, {1, -1}), "sum", "given twice");
  EXPECT_KILN_ERROR(amax(x, {5}), "amax", "dim 5");
  EXPECT_KILN_ERROR(max(x, 3), "max", "3");
  EXPECT_KILN_ERROR(mean(zeros({2}, DType::i64)), "mean", "floating");
  EXPECT_KILN_ERROR(softmax(zeros({2}, DType::i32), 0), "softmax", "floating");
  EXPECT_KILN_ERROR(amax(zeros({2, 0}), {1}), "amax", "empty");
}
