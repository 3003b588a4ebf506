// Gradient accumulation in every training dtype: --accum N over batches of B sequences is the
// same optimisation as one batch of N x B (the micro-batches' graphs are independent, and the
// bf16 copies of the f32 masters are made per forward, so a second micro-batch's backward never
// reaches a cast the first one freed).
#include <gtest/gtest.h>

#include <filesystem>

#include "kiln/train/trainer.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

std::vector<double> losses_of(const std::string& dtype, int64_t batch, int64_t accum) {
  fs::path out = test::temp_dir("accum_" + dtype + "_" + std::to_string(accum));
  train::TrainConfig c = test::tiny_run(out, 6);
  c.eval_every = 0;
  c.dtype = dtype;
  c.batch = batch;
  c.accum = accum;
  train::TrainSummary s = train::run_training(c, test::quiet());
  fs::remove_all(out);
  return s.losses;
}

}  // namespace

TEST(Train, AccumulationMatchesOneLargeBatchInEveryDtype) {
  for (const char* dtype : {"f32", "bf16"}) {
    SCOPED_TRACE(dtype);
    std::vector<double> whole = losses_of(dtype, 4, 1);
    std::vector<double> split = losses_of(dtype, 2, 2);  // failed on the 2nd micro-batch in bf16
    std::vector<double> quarters = losses_of(dtype, 1, 4);
    ASSERT_EQ(whole.size(), 6u);
    ASSERT_EQ(split.size(), 6u);
    ASSERT_EQ(quarters.size(), 6u);
    // The same sequences each step; only the order of the sums differs (and, in bf16, which
    // activations were rounded together), so the curves agree closely but not bitwise.
    const double tol = std::string(dtype) == "f32" ? 1e-4 : 2e-2;
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_NEAR(split[i], whole[i], tol * whole[i]) << "step " << i + 1;
      EXPECT_NEAR(quarters[i], whole[i], tol * whole[i]) << "step " << i + 1;
    }
  }
}
