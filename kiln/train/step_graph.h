// StepGraph: `--cuda-graphs` (docs/training.md, "CUDA graphs"). A training step's forward and
// backward, captured once as a CUDA graph (core/cuda_graph.h) and replayed at every later step:
// one launch instead of one per kernel, so the host no longer has to keep ahead of a GPU that
// finishes a kernel in a few microseconds. The optimizer (a handful of multi-tensor launches,
// whose learning rate and step count change every step) and the logging stay outside the graph.
//
// How a micro-batch runs (run()), by the state of the gradients it meets:
//   - unset (the step's first micro-batch): the first kWarmupSteps such calls run eagerly (they
//     compile kernels, measure GEMM shapes, create the optimizer's state and the rotary tables,
//     which a capture could not do); the next is captured: its batch becomes the graph's input
//     (kept, fixed addresses), the eager allocator cache is emptied (the graph's pool takes that
//     memory), the forward and backward are recorded, and the graph is replayed once to compute
//     it; the gradients and the loss it wrote are kept. Every later one copies its batch into the
//     input, replays, and sets each parameter's gradient to the tensor the graph writes;
//   - the first graph's gradients (a later micro-batch of a step, --accum): a second graph is
//     captured the first time, into the first graph's memory pool (they never run at once), its
//     backward adding into those gradients; replayed for every later micro-batch;
//   - other gradients (set by an eager step, or by the caller): the micro-batch runs eagerly (a
//     graph writes into its own gradient tensors), with a note once the graphs exist;
//   - a batch of another shape or loss divisor runs eagerly and turns graphs off for the run (an
//     eager step of another shape may rebuild tables the graphs read); a capture that fails
//     (something in the step made the host wait for the device, or copied from host memory) runs
//     the micro-batch eagerly and turns graphs off. Each says why, once, through the note callback;
//   - the host side of the captured range checks (ops/index_check.h) is queued again before each
//     replay, so an out-of-range id in a replayed step is reported as in an eager one.
// A replayed step gives the bits of an eager one: the same kernels on the same data in the same
// order (CudaGraphs.CapturedStepsGiveTheEagerBits).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/cuda_graph.h"
#include "kiln/core/tensor.h"
#include "kiln/data/dataset.h"
#include "kiln/ops/index_check.h"
#include "kiln/train/config.h"

namespace kiln::train {

// Why `cfg` cannot use CUDA graphs ("" when it can): not a CUDA run, FSDP (its collectives run on
// their own streams), --profile (it times every kernel), a document mask (built on the host from
// each batch), packed sampling (its batches' target counts differ), --optimizer-in-backward (its
// updates run in the backward with the step's learning rate), the reference attention (its mask
// is copied from the host at every forward). `sharded`: the run is FSDP-sharded.
std::string cuda_graphs_unavailable(const TrainConfig& cfg, bool sharded);

class StepGraph {
 public:
  static constexpr int64_t kWarmupSteps = 2;
  using ForwardBackward = std::function<Tensor(const data::Batch&)>;  // returns the detached loss
  using Note = std::function<void(const std::string&)>;
  using MakeGraph = std::function<std::unique_ptr<CudaGraph>()>;

  // `params`: the tensors whose gradients the backward sets (the optimizer's). `make_graph`: the
  // graphs to capture into (null: CudaGraphs; tests pass stand-ins).
  StepGraph(Device device, std::vector<Tensor> params, Note note, MakeGraph make_graph = nullptr);
  ~StepGraph();

  // One micro-batch's forward and backward of `batch` through `fb`: eager, captured or replayed
  // (above). `divisor` is the loss's divisor (a host value a capture keeps); the loss is returned.
  Tensor run(const data::Batch& batch, double divisor, const ForwardBackward& fb);

  bool active() const { return !off_; }
  int64_t replays() const { return replays_; }  // of either graph
  int64_t num_nodes() const;                     // both graphs'

 private:
  // One captured forward + backward and what it reads and writes.
  struct Captured {
    std::unique_ptr<CudaGraph> graph;
    data::Batch input;  // the captured batch: the graph reads its input and target
    double divisor = 0;
    Tensor loss;                     // written by the graph
    detail::DeferredChecks checks;   // the range checks the capture queued, queued again per replay
    bool ready() const { return graph && graph->ready(); }
  };
  enum class Gradients { unset, first_graphs, other };
  Gradients gradients(std::string* which) const;
  bool fits(const Captured& c, const data::Batch& batch, double divisor) const;
  Tensor capture(Captured& c, const data::Batch& batch, double divisor, const ForwardBackward& fb);
  Tensor replay(Captured& c, const data::Batch& batch);
  void turn_off(const std::string& why);  // for the rest of the run: the graphs and their memory go
  void note_once(const std::string& text);

  Device device_;
  std::vector<Tensor> params_;
  Note note_;
  MakeGraph make_graph_;
  Captured first_, rest_;       // the step's first micro-batch; the later ones (adding into first_'s gradients)
  std::vector<Tensor> grads_;   // per parameter: the gradient first_ writes (or undefined)
  int64_t first_calls_ = 0, replays_ = 0;
  bool off_ = false;
  std::vector<std::string> notes_;
};

}  // namespace kiln::train
