// --checkpoint-activations on a GPU (issue 35's tests: "gradients bitwise equal with and without,
// on CPU and CUDA; memory lower"; the CPU half is tests/nn/checkpoint_test.cpp): the same bf16
// training run with none, block and mlp gives every step's loss and the final checkpoint bit for
// bit, and block and mlp a lower peak, at a shape where the activations outweigh the parameters.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kiln/core/allocator.h"
#include "tests/skip.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

TEST(ActivationCheckpointCuda, TrainingGivesTheSameBitsAndALowerPeak) {
  KILN_SKIP_WITHOUT_CUDA();
  std::vector<train::TrainSummary> runs;
  std::vector<std::string> bytes;
  std::vector<int64_t> peaks;
  for (const std::string mode : {"none", "block", "mlp"}) {
    const fs::path out = temp_dir("ckpt_cuda_" + mode) / "run";
    train::TrainConfig c = tiny_run(out, 4);
    c.device = "cuda";
    c.hidden = 64;
    c.intermediate = 256;
    c.layers = 4;
    c.batch = 8;
    c.seq = 256;
    c.eval_every = 0;
    c.checkpoint_activations = mode;
    reset_peak_memory_stats(cuda(0));
    runs.push_back(train::run_training(c, quiet()));
    peaks.push_back(memory_stats(cuda(0)).peak_bytes);
    bytes.push_back(checkpoint_bytes(runs.back().checkpoint));
    ASSERT_FALSE(bytes.back().empty());
    fs::remove_all(out.parent_path());
  }
  for (size_t m = 1; m < runs.size(); ++m) {
    SCOPED_TRACE(m == 1 ? "block" : "mlp");
    ASSERT_EQ(runs[m].losses.size(), runs[0].losses.size());
    for (size_t i = 0; i < runs[0].losses.size(); ++i) EXPECT_EQ(runs[m].losses[i], runs[0].losses[i]) << "step " << i + 1;
    EXPECT_TRUE(bytes[m] == bytes[0]) << "the final checkpoints differ";
    EXPECT_LT(peaks[m], peaks[0]);
  }
}
