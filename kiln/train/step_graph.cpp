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

std::string cuda_graphs_unavailable(const TrainConfig& cfg, bool sharded) {
  if (cfg.device.rfind("cuda", 0) != 0) return "a CUDA device is needed (device '" + cfg.device + "')";
  if (sharded) return "FSDP's collectives run on their own streams, outside a graph";
  if (cfg.profile || profile::env_requested()) return "--profile (or KILN_PROFILE) times every kernel of the step";
  if (cfg.document_mask()) return "the document mask is built on the host from each batch";
  if (cfg.sample == "packed") return "packed sampling's batches differ in their count of targets (the loss divisor)";
  if (cfg.optimizer_in_backward)
    return "--optimizer-in-backward updates the parameters inside the backward with the learning rate of its step, "
           "which a graph would freeze";
  if (cfg.attention_backend(true) != "flex")
    return "the reference attention copies its mask from the host at every forward (use --attention flex)";
  return "";
}

StepGraph::StepGraph(Device device, std::vector<Tensor> params, Note note, MakeGraph make_graph)
    : device_(device),
      params_(std::move(params)),
      note_(std::move(note)),
      make_graph_(make_graph ? std::move(make_graph) : [] { return std::make_unique<CudaGraph>(); }) {}

StepGraph::~StepGraph() = default;

int64_t StepGraph::num_nodes() const {
  return (first_.graph ? first_.graph->num_nodes() : 0) + (rest_.graph ? rest_.graph->num_nodes() : 0);
}

void StepGraph::note_once(const std::string& text) {
  if (std::find(notes_.begin(), notes_.end(), text) != notes_.end()) return;
  notes_.push_back(text);
  if (note_) note_("note: --cuda-graphs: " + text);
}

StepGraph::Gradients StepGraph::gradients(std::string* which) const {
  bool unset = true, first = first_.ready();
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor g = params_[i].grad();
    if (g.defined()) {
      unset = false;
      if (which && which->empty()) *which = "a parameter of shape " + shape_str(params_[i].shape());
    }
    if (first && !(g.defined() ? g.is_same(grads_[i]) : !grads_[i].defined())) first = false;
  }
  return unset ? Gradients::unset : first ? Gradients::first_graphs : Gradients::other;
}

bool StepGraph::fits(const Captured& c, const data::Batch& b, double divisor) const {
  auto same = [](const Tensor& a, const Tensor& x) {
    return a.defined() == x.defined() &&
           (!a.defined() || (a.shape() == x.shape() && a.dtype() == x.dtype() && a.device() == x.device()));
  };
  return same(b.input, c.input.input) && same(b.target, c.input.target) && !b.doc_ids.defined() &&
         divisor == c.divisor;
}

void StepGraph::turn_off(const std::string& why) {
  off_ = true;
  for (Captured* c : {&rest_, &first_}) *c = Captured{};  // their pool goes back once nothing they wrote is held
  grads_.clear();
  note_once(why);
}

Tensor StepGraph::capture(Captured& c, const data::Batch& b, double divisor, const ForwardBackward& fb) {
  const bool first = &c == &first_;
  if (b.doc_ids.defined()) {
    turn_off("not captured: the batch has document ids, from which the model builds masks on the host");
    return fb(b);
  }
  // The eager steps' cached blocks go back, so the first graph's pool can take that memory (the
  // second one shares it).
  if (first) empty_cache(device_);
  c.graph = make_graph_();
  c.input = b;
  c.divisor = divisor;
  const size_t checks_before = detail::deferred_check_count(device_);
  auto abandon = [&] {
    c.graph->capture_abort();
    // Nothing ran while capturing: gradients the first graph's partial backward set hold no
    // values (the second one's adds, not run, left the first's values as they were).
    if (first)
      for (Tensor& p : params_) p.set_grad(Tensor());
  };
  try {
    c.graph->capture_begin(device_, first ? nullptr : first_.graph.get());
    c.loss = fb(c.input);
    c.graph->capture_end();
  } catch (const Error& e) {
    abandon();
    turn_off(std::string("the step could not be captured, it runs without a graph: ") + e.what());
    return fb(b);
  } catch (...) {
    abandon();
    turn_off("the step could not be captured");
    throw;
  }
  c.checks = detail::deferred_checks_since(device_, checks_before);
  if (first) {
    grads_.clear();
    for (const Tensor& p : params_) grads_.push_back(p.grad());
  } else {
    // The second graph may only add into the first's gradients: one it set afresh (a parameter
    // the first micro-batch left without a gradient) would be written at every replay into a
    // tensor nobody holds once the optimizer drops it. Not run yet: drop it, and go eager.
    bool fresh = false;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!grads_[i].defined() && params_[i].grad().defined()) {
        params_[i].set_grad(Tensor());
        fresh = true;
      }
    if (fresh) {
      turn_off("not captured: a later micro-batch sets the gradient of a parameter the first one left unset");
      return fb(b);
    }
  }
  c.graph->replay();  // the captured micro-batch itself (its checks are the capture's own records)
  ++replays_;
  note_once(first ? "step " + std::to_string(first_calls_) + "'s forward and backward captured as one CUDA graph of " +
                        std::to_string(c.graph->num_nodes()) + " nodes; the later steps replay it"
                  : "a later micro-batch's forward and backward captured as a second CUDA graph of " +
                        std::to_string(c.graph->num_nodes()) + " nodes (adding into the first's gradients)");
  return c.loss;
}

Tensor StepGraph::replay(Captured& c, const data::Batch& b) {
  // The host side of the graph's range checks, at the positions its kernels write: queued before
  // the replay, so that a synchronisation it needs cannot read the replay's own failures.
  detail::requeue_deferred_checks(device_, c.checks);
  {
    NoGradGuard no_grad;
    c.input.input.copy_(b.input);
    c.input.target.copy_(b.target);
  }
  c.graph->replay();
  ++replays_;
  if (&c == &first_)
    for (size_t i = 0; i < params_.size(); ++i)
      if (grads_[i].defined()) params_[i].set_grad(grads_[i]);
  return c.loss;
}

Tensor StepGraph::run(const data::Batch& b, double divisor, const ForwardBackward& fb) {
  if (off_) return fb(b);
  std::string which;
  const Gradients g = gradients(&which);
  Captured* c = nullptr;
  if (g == Gradients::unset) {
    if (first_calls_++ < kWarmupSteps) return fb(b);
    c = &first_;
  } else if (g == Gradients::first_graphs) {
    c = &rest_;
  } else {
    if (first_.ready())
      note_once("a micro-batch with the gradient of " + which + " already set (not by the graph) runs without it");
    return fb(b);
  }
  if (!c->ready()) {
    // A later micro-batch is captured only in the first one's shape.
    if (c == &first_ || fits(first_, b, divisor)) return capture(*c, b, divisor, fb);
  } else if (fits(*c, b, divisor)) {
    return replay(*c, b);
  }
  // Off for good: an eager step of another shape may rebuild tables the graphs read (the rotary
  // tables, the block mask), and the memory they held would be handed out under the graphs.
  turn_off("a step whose batch (its shape, or document ids) or loss divisor differs from the captured one: "
           "graphs are off for the rest of the run");
  return fb(b);
}

}  // namespace kiln::train
