// Self-tests of the op test harness (it must fail on a wrong gradient and on a wrong output) and
// of the comparison family it uses, tests/expect.h (all_close and same_bits must fail where a
// value is just out of bounds, NaN or inf is misplaced, the shape or dtype differs, a bit differs).
#include <gtest/gtest-spi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

// The harness runs each case on every test device: a broken op must fail once per device.
template <class F>
void expect_one_failure_per_device(F&& body, const std::string& substring) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    body();
  }
  EXPECT_EQ(results.size(), static_cast<int>(test_devices().size()));
  for (int i = 0; i < results.size(); ++i) {
    EXPECT_TRUE(results.GetTestPartResult(i).nonfatally_failed());
    EXPECT_NE(std::string(results.GetTestPartResult(i).message()).find(substring), std::string::npos)
        << results.GetTestPartResult(i).message();
  }
}

TEST(Harness, CatchesWrongGradient) {
  // y = x*x + x, with the x*x part hidden from autograd: the recorded gradient is 1, not 2x+1.
  expect_one_failure_per_device([] {
    check_op({"wrong grad", {{{3}}}, [](const std::vector<Tensor>& in) {
                return add(mul(in[0].detach(), in[0].detach()), in[0]);
              }, {DType::f64}});
  }, "finite differences");
}

TEST(Harness, CatchesDtypeDependentOutput) {
  // An op that is off by 0.1 in every dtype but f64.
  expect_one_failure_per_device([] {
    check_op({"wrong output", {{{3}}}, [](const std::vector<Tensor>& in) {
                return in[0].dtype() == DType::f64 ? in[0] : add(in[0], 0.1);
              }, {DType::f32}, false, false});
  }, "output");
}

TEST(Harness, StridedCopyIsNonContiguousWithSameValues) {
  KILN_TEST_GENERATOR(gen);
  for (Shape s : {Shape{7}, Shape{2, 3}, Shape{1, 4, 5}}) {
    Tensor t = randn(s, gen);
    Tensor v = strided_copy(t);
    EXPECT_FALSE(v.is_contiguous());
    EXPECT_TRUE(all_close(v, t, {0, 0}, "strided copy"));
  }
}

TEST(Harness, FiniteDifferencesTakeOneSideOnlyAtAKink) {
  // abs at x within h of 0: the slopes right and left are +1 and -1, their mean 0. An analytic
  // gradient of either side passes; anything else is compared with the mean and fails.
  EXPECT_EQ(fd_at_kink_or_central(1.0, 1.0, -1.0), 1.0);
  EXPECT_EQ(fd_at_kink_or_central(-1.0, 1.0, -1.0), -1.0);
  EXPECT_EQ(fd_at_kink_or_central(0.5, 1.0, -1.0), 0.0);
  // A smooth point: the central difference, whatever the analytic gradient says.
  EXPECT_DOUBLE_EQ(fd_at_kink_or_central(7.0, 2.0 + 1e-7, 2.0 - 1e-7), 2.0);
}

// ---- tests/expect.h ----

TEST(Expect, AllCloseBoundIsAtolPlusRtolTimesExpected) {
  // bound 1e-3 + 1e-2 · 100 = 1.001
  EXPECT_TRUE(all_close(100.0 + 1.0009, 100.0, {1e-3, 1e-2}));
  EXPECT_FALSE(all_close(100.0 + 1.0011, 100.0, {1e-3, 1e-2}));
  EXPECT_FALSE(all_close(100.0 - 1.0011, 100.0, {1e-3, 1e-2}));
  // relative to expected, not to got
  EXPECT_FALSE(all_close(1.0, 0.5, {0, 0.9}));
  EXPECT_TRUE(all_close(0.5, 1.0, {0, 0.9}));
  // Bound::max: max(1, 0.01 · 200) = 2, where the sum would allow 3
  EXPECT_TRUE(all_close(201.9, 200.0, {1, 0.01, Tol::Bound::max}));
  EXPECT_FALSE(all_close(202.5, 200.0, {1, 0.01, Tol::Bound::max}));
  EXPECT_TRUE(all_close(202.5, 200.0, {1, 0.01}));
  // {0, 0}: equal values only, -0 equal to +0
  EXPECT_TRUE(all_close(-0.0, 0.0, {0, 0}));
  EXPECT_FALSE(all_close(std::nextafter(1.0, 2.0), 1.0, {0, 0}));
}

TEST(Expect, AllCloseRejectsATensorJustOutOfBoundsOnEveryDevice) {
  for (Device dev : test_devices()) {
    SCOPED_TRACE(dev.str());
    const Tensor want = from_vector<double>({1.0, -2.0, 3.0, 4.0}, {2, 2});
    const double b = 1e-5 + 1e-5 * 3.0;  // element (1, 0)'s bound
    EXPECT_TRUE(all_close(from_vector<double>({1.0, -2.0, 3.0 + 0.99 * b, 4.0}, {2, 2}).to(dev), want, {1e-5, 1e-5}));
    const auto r = all_close(from_vector<double>({1.0, -2.0, 3.0 + 1.01 * b, 4.0}, {2, 2}).to(dev), want,
                             {1e-5, 1e-5}, "the output");
    EXPECT_FALSE(r);
    // what, the count, the index (flat and in the shape), the shape and the tolerances
    for (const char* part : {"the output: ", "1 of 4 elements", "[2] (1, 0)", "shape [2, 2]", "atol 1e-05"})
      EXPECT_TRUE(has_substr(r.message(), part)) << part;
    // and against float64 values
    EXPECT_FALSE(all_close(from_vector<double>({1.0, -2.0, 3.0 + 1.01 * b, 4.0}, {2, 2}).to(dev),
                           std::vector<double>{1.0, -2.0, 3.0, 4.0}, {1e-5, 1e-5}));
  }
}

TEST(Expect, AllCloseCountsEveryBadElementAndShowsTheFirstFive) {
  const std::vector<double> want(100, 1.0);
  std::vector<double> got = want;
  for (size_t i = 10; i < 90; i += 10) got[i] = 2.0;
  const auto r = all_close(got, want, {0.5, 0});
  EXPECT_FALSE(r);
  EXPECT_TRUE(has_substr(r.message(), "8 of 100 elements"));
  EXPECT_TRUE(has_substr(r.message(), "[50]"));
  EXPECT_FALSE(has_substr(r.message(), "[60]"));
}

TEST(Expect, AllCloseMatchesNaNWithNaNAndInfWithTheSameInfOnly) {
  const double nan = std::nan(""), inf = INFINITY;
  EXPECT_TRUE(all_close(nan, nan, {1e-5, 1e-5}));
  EXPECT_FALSE(all_close(nan, 1.0, {1e-5, 1e-5}));          // a NaN where a number is expected
  EXPECT_FALSE(all_close(1.0, nan, {1e-5, 1e-5}));          // a number where a NaN is expected
  EXPECT_FALSE(all_close(nan, 1.0, {INFINITY, INFINITY}));  // whatever the bound
  EXPECT_TRUE(all_close(inf, inf, {0, 0}));
  EXPECT_TRUE(all_close(-inf, -inf, {0, 0}));
  EXPECT_FALSE(all_close(-inf, inf, {1e-5, 1e-5}));
  EXPECT_FALSE(all_close(inf, 1e300, {1e-5, 1e-5}));
  EXPECT_FALSE(all_close(1e300, inf, {1e-5, 1e-5}));
  EXPECT_FALSE(all_close(inf, 1.0, {INFINITY, 0}));
  // nan_matches = false: every NaN fails, infs still match; finite_only: every NaN and inf fails
  EXPECT_FALSE(all_close(nan, nan, {.atol = 1, .nan_matches = false}));
  EXPECT_TRUE(all_close(inf, inf, {.atol = 1, .nan_matches = false}));
  EXPECT_FALSE(all_close(inf, inf, finite_only({1, 1})));
  EXPECT_TRUE(all_close(1.5, 1.0, finite_only({1, 1})));
  // and in tensors, where the rest is close
  const Tensor want = from_vector<double>({nan, inf, -inf, 1.0}, {4});
  EXPECT_TRUE(all_close(want.clone(), want, {0, 0}));
  EXPECT_TRUE(all_close(want.to(DType::f32), want.to(DType::f32), {0, 0}));
  EXPECT_FALSE(all_close(from_vector<double>({0.0, inf, -inf, 1.0}, {4}), want, {1, 1}));
  EXPECT_FALSE(all_close(from_vector<double>({nan, inf, inf, 1.0}, {4}), want, {1, 1}));
}

TEST(Expect, AllCloseRejectsAnotherShapeDtypeOrSize) {
  const Tensor a = zeros({2, 3});
  const auto r = all_close(zeros({3, 2}), a, {1, 1}, "x");
  EXPECT_FALSE(r);
  EXPECT_TRUE(has_substr(r.message(), "x: shape [3, 2], expected [2, 3]"));
  EXPECT_FALSE(all_close(zeros({6}), a, {1, 1}));
  EXPECT_FALSE(all_close(zeros({2, 3}, DType::f64), a, {1, 1}));  // the dtypes must agree: convert first
  EXPECT_TRUE(all_close(zeros({2, 3}, DType::f64), a.to(DType::f64), {0, 0}));
  EXPECT_FALSE(all_close(Tensor(), a, {1, 1}));
  EXPECT_FALSE(all_close(a, std::vector<double>(5, 0.0), {1, 1}));  // 6 elements against 5
  EXPECT_TRUE(all_close(a, std::vector<double>(6, 0.0), {0, 0}));
  EXPECT_FALSE(all_close(std::vector<float>{1, 2}, {1.0, 2.0, 3.0}, {1, 1}));
  EXPECT_TRUE(all_close(std::vector<float>{1, 2}, {1.0, 2.0}, {0, 0}));
}

TEST(Expect, DtypeTolerancesAreTheTable) {
  // one rounding against float64 (the op harness), CPU against CUDA, a collective against float64
  EXPECT_EQ(default_tol(DType::f32).atol, 1e-5);
  EXPECT_EQ(default_tol(DType::bf16).rtol, 1.6e-2);
  EXPECT_EQ(device_tol(DType::f64).rtol, 1e-12);
  EXPECT_EQ(device_tol(DType::f16).atol, 4e-3);
  EXPECT_EQ(device_tol(DType::i64).rtol, 0.0);  // integers compare exactly
  const Tol c = collective_tol(DType::bf16);
  EXPECT_EQ(c.bound, Tol::Bound::max);
  EXPECT_TRUE(all_close(100.9, 100.0, c));  // max(1e-2, 1e-2 · 100)
  EXPECT_FALSE(all_close(101.1, 100.0, c));
  EXPECT_FALSE(all_close(0.011, 0.0, c));
  EXPECT_FALSE(all_close(1.0, 1.0 + 1e-9, collective_tol(DType::f64)));
  // the rule form takes the tensors' dtype
  EXPECT_TRUE(all_close(full({3}, 1.0 + 1e-5), full({3}, 1.0), device_tol));
  EXPECT_FALSE(all_close(full({3}, 1.0 + 1e-4), full({3}, 1.0), device_tol));
}

TEST(Expect, SameBitsRejectsNegativeZeroAndAnyOtherBit) {
  for (Device dev : test_devices()) {
    SCOPED_TRACE(dev.str());
    const Tensor pos = from_vector<double>({1.0, 0.0, 2.0}, {3}).to(dev);
    const Tensor neg = from_vector<double>({1.0, -0.0, 2.0}, {3}).to(dev);
    EXPECT_TRUE(all_close(neg, pos, {0, 0}));  // equal values,
    const auto r = same_bits(neg, pos, "zeros");
    EXPECT_FALSE(r);  // other bits
    EXPECT_TRUE(has_substr(r.message(), "zeros: 1 of 3 elements differ in bits"));
    EXPECT_TRUE(has_substr(r.message(), "[1] got 0x8000000000000000 (-0), expected 0x0000000000000000 (0)"));
    EXPECT_TRUE(same_bits(pos.clone(), pos));
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) EXPECT_FALSE(same_bits(neg.to(dt), pos.to(dt)));
    EXPECT_FALSE(same_bits(pos.to(DType::f32), pos));            // another dtype
    EXPECT_FALSE(same_bits(pos.view({3, 1}), pos.view({1, 3})));  // another shape
  }
  EXPECT_FALSE(same_bits(std::vector<float>{0.0f}, std::vector<float>{-0.0f}));
  EXPECT_TRUE(same_bits(std::vector<float>{std::nanf(""), 1.0f}, std::vector<float>{std::nanf(""), 1.0f}));
  EXPECT_FALSE(same_bits(std::vector<float>{1.0f}, std::vector<float>{1.0f, 2.0f}));
}

TEST(Expect, SameBitsReadsStridedAndStorageOnlyTensors) {
  KILN_TEST_GENERATOR(gen);
  const Tensor t = randn({4, 6}, gen);
  EXPECT_TRUE(same_bits(t.t(), t.t().contiguous()));
  EXPECT_FALSE(same_bits(t.t().contiguous(), t.view({6, 4})));
  Tensor f8 = Tensor::empty({4, 6}, DType::f8_e4m3);
  std::vector<uint8_t> bytes(24);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7);
  std::memcpy(f8.data_ptr(), bytes.data(), bytes.size());
  EXPECT_TRUE(same_bits(f8.t(), f8.t().contiguous()));
  Tensor other = f8.clone();
  static_cast<uint8_t*>(other.data_ptr())[5] ^= 1;
  const auto r = same_bits(other, f8);
  EXPECT_FALSE(r);
  EXPECT_TRUE(has_substr(r.message(), "[5] (0, 5) got 0x22, expected 0x23")) << r.message();
}
