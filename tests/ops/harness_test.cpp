// Self-tests of the op test harness: it must fail on a wrong gradient and on a wrong output.
#include <gtest/gtest-spi.h>

#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

TEST(Harness, CatchesWrongGradient) {
  // y = x*x + x, with the x*x part hidden from autograd: the recorded gradient is 1, not 2x+1.
  EXPECT_NONFATAL_FAILURE(check_op({"wrong grad", {{{3}}}, [](const std::vector<Tensor>& in) {
                                      return add(mul(in[0].detach(), in[0].detach()), in[0]);
                                    }, {DType::f64}}),
                          "finite differences");
}

TEST(Harness, CatchesDtypeDependentOutput) {
  // An op that is off by 0.1 in every dtype but f64.
  EXPECT_NONFATAL_FAILURE(check_op({"wrong output", {{{3}}}, [](const std::vector<Tensor>& in) {
                                      return in[0].dtype() == DType::f64 ? in[0] : add(in[0], 0.1);
                                    }, {DType::f32}, false, false}),
                          "output");
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
