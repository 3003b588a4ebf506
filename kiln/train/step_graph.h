// StepGraph: `--cuda-graphs` (docs/training.md, "CUDA graphs"). A training step's forward and
// backward, captured once as a CUDA graph (core/cuda_graph.h) and replayed at every later step:
// one launch instead of one per kernel, so the host no longer has to keep ahead of a GPU that
// finishes a kernel in a few microseconds. The optimizer (a handful of multi-tensor launches,
// whose learning rate and step count change every step) and the logging stay outside the graph.
//
// How a step runs (run()):
//   - the first kWarmupSteps steps run eagerly: they compile kernels, measure GEMM shapes, create
//     the optimizer's state and the rotary tables, which a capture could not do;
//   - the next step is captured: its batch becomes the graph's input (kept, fixed addresses), the
//     eager allocator cache is emptied (the graph's pool takes that memory), the forward and
//     backward are recorded with every parameter's gradient unset, and the graph is replayed
//     once to compute the step; the gradients and the loss it wrote are kept;
//   - every later step copies its batch into the input, replays, and sets each parameter's
//     gradient to the tensor the graph writes (the optimizer reads and then drops them);
//   - a step with a gradient already set runs eagerly (the graph writes gradients, it does not
//     add to them); a step of another batch shape or loss divisor runs eagerly and turns graphs
//     off for the run (an eager step of another shape may rebuild tables the graph reads); a
//     capture that fails (something in the step made the host wait for the device, or copied
//     from host memory) runs the step eagerly and turns graphs off. Each says why, once, through
//     the note callback;
//   - the host side of the captured range checks (ops/index_check.h) is queued again after each
//     replay, so an out-of-range id in a replayed step is reported as in an eager one.
// A replayed step gives the bits of an eager one: the same kernels on the same data in the same
// order (Train.CudaGraphsGiveTheEagerBits).
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

// Why `cfg` cannot use CUDA graphs ("" when it can): not a CUDA run, more than one micro-batch a
// rank, FSDP (its collectives run on their own streams), --profile (it times every kernel), a
// document mask (built on the host from each batch), packed sampling (its batches' target counts
// differ), the reference attention (its mask is copied from the host at every forward).
// `sharded`: the run is FSDP-sharded.
std::string cuda_graphs_unavailable(const TrainConfig& cfg, int64_t micro_batches_per_rank, bool sharded);

class StepGraph {
 public:
  static constexpr int64_t kWarmupSteps = 2;
  using ForwardBackward = std::function<Tensor(const data::Batch&)>;  // returns the detached loss
  using Note = std::function<void(const std::string&)>;

  // `params`: the tensors whose gradients the backward sets (the optimizer's). `graph`: the
  // graph to capture into (null: a CudaGraph; tests pass a stand-in).
  StepGraph(Device device, std::vector<Tensor> params, Note note, std::unique_ptr<CudaGraph> graph = nullptr);
  ~StepGraph();

  // One step's forward and backward of `batch` through `fb`: eager, captured or replayed (above).
  // `divisor` is the loss's divisor (a host value the capture keeps); the loss is returned.
  Tensor run(const data::Batch& batch, double divisor, const ForwardBackward& fb);

  bool active() const { return !off_; }
  int64_t replays() const { return replays_; }
  int64_t num_nodes() const { return graph_ ? graph_->num_nodes() : 0; }

 private:
  bool fits(const data::Batch& batch, double divisor) const;
  bool gradients_unset(std::string* which) const;
  Tensor capture(const data::Batch& batch, double divisor, const ForwardBackward& fb);
  void turn_off(const std::string& why);  // for the rest of the run: the graph and its memory go
  void note_once(const std::string& text);

  Device device_;
  std::vector<Tensor> params_;
  Note note_;
  std::unique_ptr<CudaGraph> graph_;
  int64_t calls_ = 0, replays_ = 0;
  bool off_ = false;
  data::Batch input_;           // the captured batch: the graph reads its input and target
  double divisor_ = 0;
  Tensor loss_;                 // written by the graph
  std::vector<Tensor> grads_;   // per parameter: the gradient the graph writes (or undefined)
  detail::DeferredChecks checks_;  // the range checks the capture queued, queued again per replay
  std::vector<std::string> notes_;
};

}  // namespace kiln::train
