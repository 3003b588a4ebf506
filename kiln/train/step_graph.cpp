// StepGraph (step_graph.h): when a run can use CUDA graphs, and the eager, captured and replayed
// steps.
#include "kiln/train/step_graph.h"

#include <algorithm>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/core/profile.h"
#include "kiln/ops/index_check.h"

namespace kiln::train {

std::string cuda_graphs_unavailable(const TrainConfig& cfg, int64_t micro_batches_per_rank, bool sharded) {
  if (cfg.device.rfind("cuda", 0) != 0) return "a CUDA device is needed (device '" + cfg.device + "')";
  if (micro_batches_per_rank > 1)
    return "a step of " + std::to_string(micro_batches_per_rank) + " micro-batches (--accum or --global-batch): "
           "one micro-batch a rank is captured";
  if (sharded) return "FSDP's collectives run on their own streams, outside a graph";
  if (cfg.profile || profile::env_requested()) return "--profile (or KILN_PROFILE) times every kernel of the step";
  if (cfg.document_mask()) return "the document mask is built on the host from each batch";
  if (cfg.sample == "packed") return "packed sampling's batches differ in their count of targets (the loss divisor)";
  if (cfg.attention_backend(true) != "flex")
    return "the reference attention copies its mask from the host at every forward (use --attention flex)";
  return "";
}

StepGraph::StepGraph(Device device, std::vector<Tensor> params, Note note, std::unique_ptr<CudaGraph> graph)
    : device_(device),
      params_(std::move(params)),
      note_(std::move(note)),
      graph_(graph ? std::move(graph) : std::make_unique<CudaGraph>()) {}

StepGraph::~StepGraph() = default;

void StepGraph::note_once(const std::string& text) {
  if (std::find(notes_.begin(), notes_.end(), text) != notes_.end()) return;
  notes_.push_back(text);
  if (note_) note_("note: --cuda-graphs: " + text);
}

bool StepGraph::gradients_unset(std::string* which) const {
  for (const Tensor& p : params_)
    if (p.grad().defined()) {
      if (which) *which = "a parameter of shape " + shape_str(p.shape());
      return false;
    }
  return true;
}

bool StepGraph::fits(const data::Batch& b, double divisor) const {
  auto same = [](const Tensor& a, const Tensor& c) {
    return a.defined() == c.defined() &&
           (!a.defined() || (a.shape() == c.shape() && a.dtype() == c.dtype() && a.device() == c.device()));
  };
  return same(b.input, input_.input) && same(b.target, input_.target) && !b.doc_ids.defined() &&
         divisor == divisor_;
}

void StepGraph::turn_off(const std::string& why) {
  off_ = true;
  graph_ = nullptr;  // its pool goes back once nothing it wrote is held
  input_ = data::Batch{};
  loss_ = Tensor();
  grads_.clear();
  note_once(why);
}

Tensor StepGraph::capture(const data::Batch& b, double divisor, const ForwardBackward& fb) {
  std::string which;
  if (!gradients_unset(&which)) {
    note_once("not captured: the gradient of " + which + " was set before the step (a graph writes, not adds)");
    return fb(b);
  }
  if (b.doc_ids.defined()) {
    turn_off("not captured: the batch has document ids, from which the model builds masks on the host");
    return fb(b);
  }
  // The eager steps' cached blocks go back, so the graph's pool can take that memory.
  empty_cache(device_);
  input_ = b;
  divisor_ = divisor;
  const size_t checks_before = detail::deferred_check_count(device_);
  auto abandon = [&] {
    graph_->capture_abort();
    // Nothing ran while capturing: gradients the partial backward set hold no values.
    for (Tensor& p : params_) p.set_grad(Tensor());
  };
  try {
    graph_->capture_begin(device_);
    loss_ = fb(input_);
    graph_->capture_end();
  } catch (const Error& e) {
    abandon();
    turn_off(std::string("the step could not be captured, it runs without a graph: ") + e.what());
    return fb(b);
  } catch (...) {
    abandon();
    turn_off("the step could not be captured");
    throw;
  }
  checks_ = detail::deferred_checks_since(device_, checks_before);
  grads_.clear();
  for (const Tensor& p : params_) grads_.push_back(p.grad());
  graph_->replay();  // the captured step itself (its checks are the capture's own records)
  ++replays_;
  note_once("step " + std::to_string(calls_) + "'s forward and backward captured as one CUDA graph of " +
            std::to_string(graph_->num_nodes()) + " nodes; the later steps replay it");
  return loss_;
}

Tensor StepGraph::run(const data::Batch& b, double divisor, const ForwardBackward& fb) {
  const int64_t call = calls_++;
  if (off_ || call < kWarmupSteps) return fb(b);
  if (!graph_->ready()) return capture(b, divisor, fb);
  std::string which;
  if (!fits(b, divisor)) {
    // Off for good: an eager step of another shape may rebuild tables the graph reads (the rotary
    // tables, the block mask), and the memory they held would be handed out under the graph.
    turn_off("a step whose batch (its shape, or document ids) or loss divisor differs from the captured one: "
             "graphs are off for the rest of the run");
    return fb(b);
  }
  if (!gradients_unset(&which)) {
    note_once("a step with the gradient of " + which + " already set runs without the graph");
    return fb(b);
  }
  // The host side of the graph's range checks, at the positions its kernels write: queued before
  // the replay, so that a synchronisation it needs cannot read the replay's own failures.
  detail::requeue_deferred_checks(device_, checks_);
  {
    NoGradGuard no_grad;
    input_.input.copy_(b.input);
    input_.target.copy_(b.target);
  }
  graph_->replay();
  ++replays_;
  for (size_t i = 0; i < params_.size(); ++i)
    if (grads_[i].defined()) params_[i].set_grad(grads_[i]);
  return loss_;
}

}  // namespace kiln::train
