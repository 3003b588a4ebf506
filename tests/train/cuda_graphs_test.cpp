// --cuda-graphs (kiln/train/step_graph.h): which runs can use them and the refusal of `on` where
// a run cannot; StepGraph's eager, captured, replayed and fallback steps through a stand-in graph
// (CPU); and on a GPU that the captured and replayed steps give the bits of the eager ones.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kiln/core/cuda_graph.h"
#include "kiln/core/error.h"
#include "kiln/ops/ops.h"
#include "kiln/train/step_graph.h"
#include "tests/skip.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

TEST(CudaGraphs, WhereARunCannotUseThem) {
  train::TrainConfig c = tiny_run("/tmp/unused", 1);
  c.device = "cuda";
  EXPECT_EQ(train::cuda_graphs_unavailable(c, false), "");  // --accum too: its second graph (below)
  EXPECT_NE(train::cuda_graphs_unavailable(c, true).find("FSDP"), std::string::npos);
  train::TrainConfig p = c;
  p.profile = true;
  EXPECT_NE(train::cuda_graphs_unavailable(p, false).find("--profile"), std::string::npos);
  train::TrainConfig d = c;
  d.sample = "packed";
  d.attention_mask = "document";
  EXPECT_NE(train::cuda_graphs_unavailable(d, false).find("document mask"), std::string::npos);
  train::TrainConfig packed = c;
  packed.sample = "packed";
  packed.attention_mask = "causal";  // (auto would mean the document mask with packed sampling)
  EXPECT_NE(train::cuda_graphs_unavailable(packed, false).find("packed sampling"), std::string::npos);
  train::TrainConfig reference = c;
  reference.attention = "reference";
  EXPECT_NE(train::cuda_graphs_unavailable(reference, false).find("reference attention"), std::string::npos);
  train::TrainConfig cpu = c;
  cpu.device = "cpu";
  EXPECT_NE(train::cuda_graphs_unavailable(cpu, false).find("a CUDA device is needed"), std::string::npos);

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

namespace {

// Stands in for the GPU's graph: "capturing" runs the work at once (the CPU has nothing to defer),
// a replay only counts; so the test sees StepGraph's decisions, not a GPU's arithmetic.
class FakeGraph : public CudaGraph {
 public:
  int* replays = nullptr;
  bool fail_capture = false;
  bool began = false, ended = false;
  const CudaGraph* shared_with = nullptr;
  void capture_begin(const Device&, const CudaGraph* share_pool_of) override {
    began = true;
    shared_with = share_pool_of;
  }
  void capture_end() override {
    if (fail_capture) fail("fake graph: something in the step synchronised");
    ended = true;
  }
  void capture_abort() noexcept override { began = false; }
  int own_replays = 0;  // this graph's (replays counts every graph's of a rig)
  void replay() override {
    ++*replays;
    ++own_replays;
  }
  bool ready() const override { return ended; }
  int64_t num_nodes() const override { return ended ? 1 : 0; }
};

data::Batch batch_of(int64_t rows, float value) {
  data::Batch b;
  b.input = full({rows, 3}, value, DType::f32).to(DType::i64);
  b.target = zeros({rows, 3}, DType::i64);
  b.num_targets = rows * 3;
  return b;
}

// A StepGraph over a stand-in graph and one parameter w, counting the graph's replays, the forward
// and backward's runs and the notes. loss = sum over rows of w . input_row: dL/dw = the input's
// column sums.
struct Rig {
  Tensor w = full({3}, 2.0f, DType::f32).requires_grad_();
  int replays = 0, runs = 0;
  std::vector<std::string> notes;
  FakeGraph* graph = nullptr;           // the first graph made (valid while the StepGraph holds it)
  std::vector<FakeGraph*> graphs;       // every graph made, in order
  bool fail_capture = false;
  std::unique_ptr<train::StepGraph> sg;
  train::StepGraph::ForwardBackward fb = [this](const data::Batch& b) {
    ++runs;
    Tensor l = sum(mul(b.input.to(DType::f32), w));
    l.backward();
    return l.detach();
  };
  explicit Rig(bool fail = false) : fail_capture(fail) {
    sg = std::make_unique<train::StepGraph>(
        kCPU, std::vector<Tensor>{w}, [this](const std::string& n) { notes.push_back(n); }, [this] {
          auto fake = std::make_unique<FakeGraph>();
          fake->replays = &replays;
          fake->fail_capture = fail_capture;
          graphs.push_back(fake.get());
          if (!graph) graph = fake.get();
          return fake;
        });
  }
};

}  // namespace

TEST(CudaGraphs, StepGraphWarmsUpCapturesReplaysAndFallsBackWithNotes) {
  Rig r;
  auto& [w, replays, runs, notes, graph, graphs, fail, sg_ptr, fb] = r;
  train::StepGraph& sg = *sg_ptr;
  auto step = [&](const data::Batch& b, double divisor) {
    Tensor l = sg.run(b, divisor, fb);
    Tensor g = w.grad();
    w.set_grad(Tensor());  // the optimizer's zero_grad
    return std::make_pair(l, g);
  };
  for (int64_t i = 0; i < train::StepGraph::kWarmupSteps; ++i) {  // eager
    auto [l, g] = step(batch_of(2, 1.0f), 6);
    EXPECT_EQ(l.item(), 12.0);
    EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{2, 2, 2}));
  }
  EXPECT_EQ(replays, 0);
  EXPECT_EQ(graph, nullptr);  // no graph made during the warm-up
  auto [l2, g2] = step(batch_of(2, 1.0f), 6);  // captured, then replayed once
  ASSERT_NE(r.graph, nullptr);
  EXPECT_TRUE(r.graph->ready());
  EXPECT_EQ(r.graph->shared_with, nullptr);  // the first graph has a pool of its own
  EXPECT_EQ(replays, 1);
  EXPECT_EQ(runs, 3);
  EXPECT_EQ(l2.item(), 12.0);
  auto [l3, g3] = step(batch_of(2, 5.0f), 6);  // replayed: no run, the captured gradient set again
  EXPECT_EQ(replays, 2);
  EXPECT_EQ(runs, 3);
  EXPECT_TRUE(g3.is_same(g2));
  EXPECT_TRUE(l3.is_same(l2));
  ASSERT_EQ(notes.size(), 1u);  // the capture says so once
  EXPECT_NE(notes[0].find("note: --cuda-graphs: step 3's forward and backward captured as one CUDA graph of 1 nodes"),
            std::string::npos) << notes[0];
  w.set_grad(full({3}, 1.0f, DType::f32));  // a gradient left set: eager (the graph writes, not adds)
  auto [l4, g4] = step(batch_of(2, 1.0f), 6);
  EXPECT_EQ(runs, 4);
  EXPECT_EQ(g4.to_vector<float>(), (std::vector<float>{3, 3, 3}));
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[1].find("already set"), std::string::npos) << notes[1];
  step(batch_of(2, 1.0f), 6);  // and back on the graph
  EXPECT_EQ(replays, 3);
  EXPECT_EQ(runs, 4);
  EXPECT_TRUE(sg.active());
  auto [l6, g6] = step(batch_of(3, 1.0f), 9);  // another shape: eager, graphs off for good, a note
  EXPECT_EQ(runs, 5);
  EXPECT_EQ(l6.item(), 18.0);
  EXPECT_FALSE(sg.active());
  EXPECT_EQ(sg.num_nodes(), 0);  // the graph (and its memory) is gone
  ASSERT_EQ(notes.size(), 3u);
  EXPECT_NE(notes[2].find("or loss divisor differs from the captured one"), std::string::npos) << notes[2];
  step(batch_of(2, 1.0f), 6);  // the captured shape again: eager from now on, nothing more said
  EXPECT_EQ(runs, 6);
  EXPECT_EQ(notes.size(), 3u);
  EXPECT_EQ(sg.replays(), 3);
}

TEST(CudaGraphs, AnotherLossDivisorTurnsGraphsOff) {
  Rig r;
  for (int i = 0; i <= train::StepGraph::kWarmupSteps; ++i) {
    r.sg->run(batch_of(2, 1.0f), 6, r.fb);
    r.w.set_grad(Tensor());
  }
  EXPECT_EQ(r.replays, 1);
  r.sg->run(batch_of(2, 1.0f), 5, r.fb);  // same shape, fewer targets counted
  EXPECT_FALSE(r.sg->active());
  EXPECT_EQ(r.runs, 4);
}

TEST(CudaGraphs, ABatchWithDocumentIdsIsNotCaptured) {
  Rig r;
  data::Batch b = batch_of(2, 1.0f);
  b.doc_ids = zeros({2, 3}, DType::i64);
  for (int i = 0; i <= train::StepGraph::kWarmupSteps; ++i) {
    r.sg->run(b, 6, r.fb);
    r.w.set_grad(Tensor());
  }
  EXPECT_EQ(r.replays, 0);  // (the stand-in graph went with the StepGraph's graph: not read here)
  EXPECT_FALSE(r.sg->active());
  EXPECT_EQ(r.runs, 3);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find("document ids"), std::string::npos) << r.notes[0];
}

// --accum: the step's later micro-batches get a second graph, captured into the first's pool,
// that adds into the first graph's gradients; each later step replays the first graph, then the
// second for every later micro-batch.
TEST(CudaGraphs, LaterMicroBatchesGetASecondGraphThatAddsIntoTheFirstsGradients) {
  Rig r;
  auto step = [&](float v0, float v1, float v2) {  // three micro-batches
    std::vector<double> losses;
    for (float v : {v0, v1, v2}) losses.push_back(r.sg->run(batch_of(2, v), 18, r.fb).item());
    const std::vector<float> g = r.w.grad().to_vector<float>();
    r.w.set_grad(Tensor());
    return std::make_pair(losses, g);
  };
  for (int i = 0; i < train::StepGraph::kWarmupSteps; ++i) {  // eager, no note
    auto [l, g] = step(1, 1, 1);
    EXPECT_EQ(g, (std::vector<float>{6, 6, 6}));
  }
  EXPECT_EQ(r.runs, 6);
  EXPECT_TRUE(r.graphs.empty());
  EXPECT_TRUE(r.notes.empty());
  auto [l3, g3] = step(1, 1, 1);  // the first graph captured, the second captured, the second replayed
  ASSERT_EQ(r.graphs.size(), 2u);
  EXPECT_EQ(r.graphs[1]->shared_with, r.graphs[0]);  // one pool for both
  EXPECT_EQ(r.runs, 8);                              // the two captures ran the work (the stand-in)
  EXPECT_EQ(r.replays, 3);
  EXPECT_EQ(g3, (std::vector<float>{4, 4, 4}));  // the two captures' runs (the stand-in's replays compute nothing)
  ASSERT_EQ(r.notes.size(), 2u);
  EXPECT_NE(r.notes[1].find("second CUDA graph"), std::string::npos) << r.notes[1];
  EXPECT_EQ(r.graphs[0]->own_replays, 1);
  EXPECT_EQ(r.graphs[1]->own_replays, 2);
  // replays only: the first graph once, its gradient set, then the second twice, adding into it
  r.sg->run(batch_of(2, 1.0f), 18, r.fb);
  const Tensor first_grad = r.w.grad();
  ASSERT_TRUE(first_grad.defined());
  r.sg->run(batch_of(2, 1.0f), 18, r.fb);
  r.sg->run(batch_of(2, 1.0f), 18, r.fb);
  EXPECT_TRUE(r.w.grad().is_same(first_grad));
  r.w.set_grad(Tensor());
  EXPECT_EQ(r.runs, 8);
  EXPECT_EQ(r.graphs[0]->own_replays, 2);
  EXPECT_EQ(r.graphs[1]->own_replays, 4);
  EXPECT_EQ(r.graphs.size(), 2u);
  EXPECT_TRUE(r.sg->active());
  // a later micro-batch of another shape: graphs off, the first micro-batch's gradient kept and
  // added to eagerly
  r.sg->run(batch_of(2, 1.0f), 18, r.fb);
  const Tensor kept = r.w.grad();
  r.sg->run(batch_of(3, 1.0f), 18, r.fb);
  EXPECT_FALSE(r.sg->active());
  EXPECT_TRUE(r.w.grad().is_same(kept));
  EXPECT_EQ(r.runs, 9);
}

// A later micro-batch of another shape at the capture step: the second graph is not captured.
TEST(CudaGraphs, ASecondGraphIsCapturedOnlyInTheFirstsShape) {
  Rig r;
  for (int i = 0; i < train::StepGraph::kWarmupSteps; ++i) {
    for (int m = 0; m < 2; ++m) r.sg->run(batch_of(2, 1.0f), 12, r.fb);
    r.w.set_grad(Tensor());
  }
  r.sg->run(batch_of(2, 1.0f), 12, r.fb);  // the first graph
  r.sg->run(batch_of(4, 1.0f), 12, r.fb);  // another shape: eager, graphs off
  EXPECT_EQ(r.graphs.size(), 1u);
  EXPECT_FALSE(r.sg->active());
  ASSERT_EQ(r.notes.size(), 2u);
  EXPECT_NE(r.notes[1].find("differs from the captured one"), std::string::npos) << r.notes[1];
}

// The second graph's capture fails: the first micro-batch's gradients (the first graph's, already
// computed) are kept, and the rest of the step adds into them eagerly.
TEST(CudaGraphs, AFailedSecondCaptureKeepsTheFirstMicroBatchsGradients) {
  Rig r;
  for (int i = 0; i < train::StepGraph::kWarmupSteps; ++i) {
    for (int m = 0; m < 3; ++m) r.sg->run(batch_of(2, 1.0f), 18, r.fb);
    r.w.set_grad(Tensor());
  }
  r.sg->run(batch_of(2, 1.0f), 18, r.fb);  // the first graph captured (its run gives 2 a column)
  r.fail_capture = true;                   // the second graph's capture will fail
  r.sg->run(batch_of(2, 1.0f), 18, r.fb);
  r.sg->run(batch_of(2, 1.0f), 18, r.fb);
  // Kept, not cleared: 2 (the first capture's run) + 2 + 2 (the two eager micro-batches), and 2
  // more from the failed capture's own run, which the stand-in executes (on a GPU nothing runs
  // while capturing, and the sum is 6); cleared, it would be 4.
  EXPECT_EQ(r.w.grad().to_vector<float>(), (std::vector<float>{8, 8, 8}));
  EXPECT_FALSE(r.sg->active());
  ASSERT_EQ(r.notes.size(), 2u);
  EXPECT_NE(r.notes[1].find("could not be captured"), std::string::npos) << r.notes[1];
}

TEST(CudaGraphs, AFailedCaptureRunsTheStepEagerlyAndTurnsGraphsOff) {
  Rig r(/*fail=*/true);
  auto& [w, replays, runs, notes, graph, graphs, fail, sg_ptr, fb] = r;
  train::StepGraph& sg = *sg_ptr;
  for (int i = 0; i < 4; ++i) {
    Tensor l = sg.run(batch_of(2, 1.0f), 6, fb);
    EXPECT_EQ(l.item(), 12.0) << i;
    // the failed capture's gradient is dropped before the step runs again: not accumulated twice
    EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{2, 2, 2})) << i;
    w.set_grad(Tensor());
  }
  EXPECT_EQ(runs, 5);  // two eager, the capture's run, its eager rerun, one more eager
  EXPECT_EQ(replays, 0);
  EXPECT_FALSE(sg.active());
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("could not be captured"), std::string::npos) << notes[0];
  EXPECT_NE(notes[0].find("something in the step synchronised"), std::string::npos) << notes[0];
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
  for (const auto& [fused, accum] : {std::pair{false, 1}, {true, 1}, {false, 3}}) {
    std::vector<train::TrainSummary> runs;
    std::vector<std::string> weights;  // the final checkpoint's safetensors files (model and optimizer)
    for (const std::string mode : {"off", "on"}) {
      const fs::path out = temp_dir("graphs_bits_" + mode) / "run";
      train::TrainConfig c = tiny_run(out, 8);
      c.device = "cuda";
      c.cuda_graphs = mode;
      c.fused_loss = fused;
      c.accum = accum;  // 3: the second graph, replayed twice a step, adding into the first's gradients
      c.eval_every = 4;
      c.ckpt_every = 0;
      runs.push_back(train::run_training(c, quiet()));
      weights.push_back(checkpoint_bytes(runs.back().checkpoint));
      ASSERT_FALSE(weights.back().empty()) << runs.back().checkpoint;
      fs::remove_all(out.parent_path());
    }
    SCOPED_TRACE(std::string(fused ? "fused loss" : "unfused loss") + ", accum " + std::to_string(accum));
    EXPECT_EQ(runs[0].graph_replays, 0);
    EXPECT_EQ(runs[1].graph_replays, (8 - train::StepGraph::kWarmupSteps) * accum);
    ASSERT_EQ(runs[0].losses.size(), runs[1].losses.size());
    for (size_t i = 0; i < runs[0].losses.size(); ++i) EXPECT_EQ(runs[0].losses[i], runs[1].losses[i]) << "step " << i + 1;
    EXPECT_EQ(runs[0].final_eval_loss, runs[1].final_eval_loss);
    EXPECT_TRUE(weights[0] == weights[1]) << "the final checkpoints differ";
  }
}

// A replayed step's range checks report an out-of-range id as an eager step's do: the host side
// of the captured checks is queued again before each replay (ops/index_check.h).
TEST(CudaGraphs, AReplayedStepReportsAnOutOfRangeId) {
  KILN_SKIP_WITHOUT_CUDA();
  Tensor w = full({5, 4}, 0.5f, DType::f32, cuda(0)).requires_grad_();
  std::vector<std::string> notes;
  train::StepGraph sg(cuda(0), {w}, [&](const std::string& n) { notes.push_back(n); });
  auto fb = [&](const data::Batch& b) {
    Tensor l = sum(embedding(w, b.input));
    l.backward();
    return l.detach();
  };
  auto batch = [](std::vector<int64_t> ids) {
    data::Batch b;
    b.input = from_vector(ids, {1, 4}, cuda(0));
    b.target = zeros({1, 4}, DType::i64, cuda(0));
    b.num_targets = 4;
    return b;
  };
  for (int i = 0; i < 5; ++i) {  // two eager steps, the capture, two replays
    EXPECT_EQ(sg.run(batch({0, 1, 2, 3}), 4, fb).item(), 8.0) << i;
    w.set_grad(Tensor());
  }
  EXPECT_EQ(sg.replays(), 3);
  // Another op's check queued with no synchronisation since (a 3-row table, ids in range): the
  // replay's failure must still be named after the graph's own check, not this one.
  const Tensor other_table = full({3, 4}, 1.0f, DType::f32, cuda(0));
  const Tensor other = embedding(other_table, from_vector(std::vector<int64_t>{0, 1, 2, 0}, {4}, cuda(0)));
  Tensor l = sg.run(batch({0, 1, 7, 3}), 4, fb);
  const std::string e = error_of([&] { l.item(); });
  EXPECT_NE(e.find("embedding: ids[2]=7 out of range [0, 5)"), std::string::npos) << e;
  w.set_grad(Tensor());
  EXPECT_EQ(sg.run(batch({0, 1, 2, 3}), 4, fb).item(), 8.0);  // and the next replay is clean
  EXPECT_TRUE(sg.active());
  for (const std::string& n : notes) EXPECT_EQ(n.find("could not be captured"), std::string::npos) << n;
}
