// --cuda-graphs (kiln/train/step_graph.h): which runs can use them and the refusal of `on` where
// a run cannot (CPU), and on a GPU that the captured and replayed steps give the bits of the
// eager ones, and that a batch the graph does not fit runs eagerly.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kiln/core/cuda_graph.h"
#include "kiln/train/step_graph.h"
#include "tests/skip.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

TEST(CudaGraphs, WhereARunCannotUseThem) {
  train::TrainConfig c = tiny_run("/tmp/unused", 1);
  c.device = "cuda";
  EXPECT_EQ(train::cuda_graphs_unavailable(c, 1, false), "");
  EXPECT_NE(train::cuda_graphs_unavailable(c, 2, false).find("a step of 2 micro-batches"), std::string::npos);
  EXPECT_NE(train::cuda_graphs_unavailable(c, 1, true).find("FSDP"), std::string::npos);
  train::TrainConfig p = c;
  p.profile = true;
  EXPECT_NE(train::cuda_graphs_unavailable(p, 1, false).find("--profile"), std::string::npos);
  train::TrainConfig d = c;
  d.sample = "packed";
  d.attention_mask = "document";
  EXPECT_NE(train::cuda_graphs_unavailable(d, 1, false).find("document mask"), std::string::npos);
  train::TrainConfig cpu = c;
  cpu.device = "cpu";
  EXPECT_NE(train::cuda_graphs_unavailable(cpu, 1, false).find("a CUDA device is needed"), std::string::npos);

  train::TrainConfig bad = c;
  bad.cuda_graphs = "sometimes";
  EXPECT_NE(error_of([&] { bad.validate(); }).find("cuda_graphs='sometimes' is not one of: auto, on, off"),
            std::string::npos);
}

TEST(CudaGraphs, OnIsRefusedBeforeTheRunWhereItCannotApply) {
  const fs::path out = temp_dir("graphs_on") / "run";
  train::TrainConfig c = tiny_run(out, 2);
  c.cuda_graphs = "on";  // on the CPU
  EXPECT_NE(error_of([&] { train::run_training(c, quiet()); }).find("--cuda-graphs on: a CUDA device is needed"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(out));
  c.cuda_graphs = "auto";  // the CPU run trains as before, without a note or a graph
  const train::TrainSummary s = train::run_training(c, quiet());
  EXPECT_EQ(s.steps_done, 2);
  EXPECT_EQ(s.graph_replays, 0);
  fs::remove_all(out.parent_path());
}

TEST(CudaGraphs, ABuildWithoutCudaSaysSo) {
  if (cuda_built()) GTEST_SKIP() << "built with CUDA";
  CudaGraph g;
  EXPECT_NE(error_of([&] { g.capture_begin(cuda(0)); }).find("built without CUDA"), std::string::npos);
  EXPECT_FALSE(g.ready());
}

// The same run with and without graphs: every step's loss, the eval loss and the final checkpoint
// (weights and optimizer state) bit for bit (the replays run the captured kernels on the same data in the same order), with a
// replay for every step after the warm-up and the capture.
TEST(CudaGraphs, CapturedStepsGiveTheEagerBits) {
  KILN_SKIP_WITHOUT_CUDA();
  for (const bool fused : {false, true}) {
    std::vector<train::TrainSummary> runs;
    std::vector<std::string> weights;  // the final checkpoint's safetensors files (model and optimizer)
    for (const std::string mode : {"off", "on"}) {
      const fs::path out = temp_dir("graphs_bits_" + mode) / "run";
      train::TrainConfig c = tiny_run(out, 8);
      c.device = "cuda";
      c.cuda_graphs = mode;
      c.fused_loss = fused;
      c.eval_every = 4;
      c.ckpt_every = 0;
      runs.push_back(train::run_training(c, quiet()));
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(runs.back().checkpoint))
        if (e.path().extension() == ".safetensors") files.push_back(e.path());
      std::sort(files.begin(), files.end());
      ASSERT_FALSE(files.empty()) << runs.back().checkpoint;
      std::string bytes;
      for (const fs::path& f : files) {
        std::ifstream in(f, std::ios::binary);
        bytes += f.filename().string() + std::string(std::istreambuf_iterator<char>(in), {});
      }
      weights.push_back(bytes);
      fs::remove_all(out.parent_path());
    }
    SCOPED_TRACE(fused ? "fused loss" : "unfused loss");
    EXPECT_EQ(runs[0].graph_replays, 0);
    EXPECT_EQ(runs[1].graph_replays, 8 - train::StepGraph::kWarmupSteps);
    ASSERT_EQ(runs[0].losses.size(), runs[1].losses.size());
    for (size_t i = 0; i < runs[0].losses.size(); ++i) EXPECT_EQ(runs[0].losses[i], runs[1].losses[i]) << "step " << i + 1;
    EXPECT_EQ(runs[0].final_eval_loss, runs[1].final_eval_loss);
    EXPECT_TRUE(weights[0] == weights[1]) << "the final checkpoints differ";
  }
}
