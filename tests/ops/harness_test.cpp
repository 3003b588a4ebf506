// Self-tests of the op test harness: it must fail on a wrong gradient and on a wrong output.
#include <gtest/gtest-spi.h>

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
