// kiln train --optimizer-in-backward (optim/in_backward.h): the same bits as the run that steps
// after the backward (with --clip 0, the one clip it allows), in f32 and in bf16, on the CPU and (the
// last test) on a GPU; a lower peak where the gradients are most of the memory; a non-finite norm
// stopping the run before it saves; the settings it cannot run with refused before the run.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kiln/io/json.h"
#include "kiln/train/step_graph.h"
#include "kiln/train/trainer.h"
#include "tests/expect.h"
#include "tests/skip.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
using kiln::test::error_of;
namespace fs = std::filesystem;

namespace {

struct TrainedRun {
  train::TrainSummary summary;
  std::string weights;  // the final checkpoint's safetensors files
};

// A tied embedding (its gradient from the LM head and the embedding summed before its hook runs)
// and, with `checkpointed`, block checkpointing (each block's parameters reached in a nested
// backward).
TrainedRun train_tiny(const std::string& dtype, bool in_backward, const std::string& name, bool checkpointed = false) {
  const fs::path out = test::temp_dir("oib_" + name) / "run";
  train::TrainConfig c = test::tiny_run(out, 7);
  c.dtype = dtype;
  c.tie_embeddings = true;
  if (checkpointed) c.checkpoint_activations = "block";
  c.clip = 0;
  c.optimizer_in_backward = in_backward;
  TrainedRun r{train::run_training(c, test::quiet()), ""};
  r.weights = test::checkpoint_bytes(r.summary.checkpoint);
  fs::remove_all(out.parent_path());
  return r;
}

}  // namespace

TEST(OptimizerInBackwardTrain, GivesTheBitsOfTheStepAfterTheBackward) {
  for (const auto& [dtype, checkpointed] : {std::pair{"f32", false}, {"bf16", false}, {"bf16", true}}) {
    SCOPED_TRACE(std::string(dtype) + (checkpointed ? " block checkpointing" : ""));
    const std::string tag = std::string(dtype) + (checkpointed ? "_ckpt" : "");
    const TrainedRun after = train_tiny(dtype, false, tag + "_after", checkpointed);
    const TrainedRun inside = train_tiny(dtype, true, tag + "_inside", checkpointed);
    ASSERT_EQ(inside.summary.losses.size(), 7u);
    EXPECT_TRUE(test::same_bits(inside.summary.losses, after.summary.losses, "losses"));
    EXPECT_EQ(inside.summary.final_eval_loss, after.summary.final_eval_loss);
    ASSERT_FALSE(after.weights.empty());
    EXPECT_TRUE(inside.weights == after.weights) << "the final weights and optimizer state differ";
  }
}

// Where the gradients are most of a step's memory (a wide MLP, few tokens), freeing each one as it
// is used lowers the peak by most of their size.
TEST(OptimizerInBackwardTrain, HoldsLessThanAllTheGradientsAtOnce) {
  auto peak = [](bool in_backward) {
    const fs::path out = test::temp_dir(in_backward ? "oib_peak_in" : "oib_peak_after") / "run";
    train::TrainConfig c = test::tiny_run(out, 2);
    c.hidden = 128;
    c.intermediate = 1024;
    c.batch = 1;
    c.seq = 8;
    c.eval_every = 0;
    c.clip = 0;
    c.optimizer_in_backward = in_backward;
    const int64_t bytes = train::run_training(c, test::quiet()).peak_memory_bytes;
    fs::remove_all(out.parent_path());
    return bytes;
  };
  const int64_t after = peak(false), inside = peak(true);
  // 2 layers x 3 x 128 x 1024 MLP weights alone are 3 MiB of f32 gradients.
  EXPECT_LT(inside, after - 2 * (int64_t{1} << 20)) << "peak " << inside << " bytes, " << after << " without";
}

// A non-finite gradient norm has been applied when it is known: the run stops at that step with
// an error, before its interval checkpoint (the last one written stays the latest).
TEST(OptimizerInBackwardTrain, ANonFiniteNormStopsTheRunBeforeItSaves) {
  const fs::path out = test::temp_dir("oib_nonfinite") / "run";
  train::TrainConfig c = test::tiny_run(out, 6);
  c.clip = 0;
  c.optimizer_in_backward = true;
  c.lr = 1e30;  // step 1's update makes the weights ~1e30: step 2's gradients are not finite
  c.warmup = 0;
  c.eval_every = 0;
  c.ckpt_every = 1;
  const std::string e = error_of([&] { train::run_training(c, test::quiet()); });
  EXPECT_NE(e.find("non-finite gradient norm"), std::string::npos) << e;
  EXPECT_NE(e.find("with --optimizer-in-backward"), std::string::npos) << e;
  EXPECT_TRUE(fs::exists(out / "step-1")) << "step 1's checkpoint (finite weights)";
  for (int s = 2; s <= 6; ++s) EXPECT_FALSE(fs::exists(out / ("step-" + std::to_string(s)))) << "step " << s;
  fs::remove_all(out.parent_path());
}

TEST(OptimizerInBackwardTrain, SettingsItCannotRunWithAreRefused) {
  const fs::path out = test::temp_dir("oib_refused") / "run";
  train::TrainConfig c = test::tiny_run(out, 2);
  c.optimizer_in_backward = true;
  c.clip = 0;
  train::TrainConfig clipped = c;
  clipped.clip = 1.0;
  EXPECT_NE(error_of([&] { clipped.validate(); }).find("it needs clip=0 (no clipping), got clip=1"),
            std::string::npos);
  train::TrainConfig accum = c;
  accum.accum = 2;
  EXPECT_NE(error_of([&] { accum.validate(); }).find("it needs accum=1 (one micro-batch a step), got accum=2"),
            std::string::npos);
  train::TrainConfig ranks = c;
  ranks.nproc = 2;
  EXPECT_NE(error_of([&] { ranks.validate(); }).find("it cannot run FSDP-sharded (nproc=2)"), std::string::npos);
  train::TrainConfig sharded = c;
  sharded.fsdp = true;  // a world of one, sharded
  EXPECT_NE(error_of([&] { sharded.validate(); }).find("it cannot run FSDP-sharded (nproc=1, fsdp)"),
            std::string::npos);
  train::TrainConfig global = c;
  global.global_batch = 2 * c.batch;  // two micro-batches a step in one process
  EXPECT_NE(error_of([&] { train::run_training(global, test::quiet()); })
                .find("needs one micro-batch a step (it uses up each gradient in the backward); this run has 2 "
                      "micro-batches a step (--global-batch)"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(out));
  train::TrainConfig graphs = c;
  graphs.device = "cuda";
  EXPECT_NE(train::cuda_graphs_unavailable(graphs, false).find("--optimizer-in-backward"), std::string::npos);
  fs::remove_all(out.parent_path());
}

// On a GPU, bf16 (graphs off in both runs: only where the update runs differs): every step's loss
// and gradient norm and the final weights and optimizer state bit for bit, and a lower peak at a
// shape whose gradients outweigh its activations.
TEST(OptimizerInBackwardCuda, GivesTheBitsAndALowerPeak) {
  KILN_SKIP_WITHOUT_CUDA();
  std::vector<std::vector<double>> losses, norms;
  std::vector<std::string> bytes;
  std::vector<int64_t> peaks;
  for (const bool in_backward : {false, true}) {
    const fs::path out = test::temp_dir(in_backward ? "oib_cuda_in" : "oib_cuda_after") / "run";
    train::TrainConfig c = test::tiny_run(out, 5);
    c.device = "cuda";
    c.hidden = 256;
    c.intermediate = 2048;
    c.batch = 1;
    c.seq = 64;
    c.eval_every = 0;
    c.clip = 0;
    c.cuda_graphs = "off";
    c.optimizer_in_backward = in_backward;
    std::vector<double> norm;
    train::TrainHooks hooks = test::quiet();
    hooks.on_log = [&](const json::Value& r) { norm.push_back(r.find("grad_norm")->as_double("grad_norm")); };
    const train::TrainSummary s = train::run_training(c, hooks);
    losses.push_back(s.losses);
    norms.push_back(norm);
    peaks.push_back(s.peak_memory_bytes);
    bytes.push_back(test::checkpoint_bytes(s.checkpoint));
    ASSERT_FALSE(bytes.back().empty());
    fs::remove_all(out.parent_path());
  }
  ASSERT_EQ(losses[0].size(), 5u);
  EXPECT_TRUE(test::same_bits(losses[1], losses[0], "losses"));
  ASSERT_EQ(norms[0].size(), 5u);
  EXPECT_TRUE(test::same_bits(norms[1], norms[0], "gradient norms"));
  EXPECT_TRUE(bytes[1] == bytes[0]) << "the final weights and optimizer state differ";
  // 2 layers x 3 x 256 x 2048 MLP weights alone are 12 MiB of f32 gradients
  EXPECT_LT(peaks[1], peaks[0] - 8 * (int64_t{1} << 20)) << peaks[1] << " bytes against " << peaks[0];
}
