// Node: one step of the backward graph. An op that records history makes a FunctionNode whose
// backward closure maps the gradients of its outputs to the gradients of its inputs; edges
// lead to the nodes that produced those inputs (or to the accumulator of a leaf).
// SavedTensor keeps a tensor for backward together with its version at save time, so that an
// in-place edit in between makes backward fail with a clear message.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln {

struct Edge {
  std::shared_ptr<Node> node;  // null: the input needs no gradient
  int input_nr = 0;            // which output of `node` the gradient flows into
};

struct OutputMeta {
  Shape shape;
  DType dtype = DType::f32;
  Device device;
};

class Node {
 public:
  virtual ~Node();  // frees long chains iteratively (engine.cpp)
  // grads[i] is the gradient of output i (always defined: zeros stand in for unused outputs).
  virtual std::vector<Tensor> apply(const std::vector<Tensor>& grads) = 0;
  virtual std::string name() const = 0;
  // Frees what was saved for backward (after a backward without retain_graph).
  virtual void release() {}

  std::vector<Edge> next;          // one per input of the op
  std::vector<OutputMeta> outputs; // one per output of the op
};

class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& t);
  // The saved tensor; throws when it was modified in place after being saved.
  Tensor get(const std::string& op) const;
  bool defined() const { return tensor_.defined(); }

 private:
  Tensor tensor_;  // a detached alias: no autograd history, so no reference cycles
  uint64_t version_ = 0;
};

using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& grads)>;

class FunctionNode final : public Node {
 public:
  FunctionNode(std::string name, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::vector<Tensor> apply(const std::vector<Tensor>& grads) override;
  std::string name() const override { return name_; }
  void release() override;

 private:
  std::string name_;
  BackwardFn fn_;
  bool released_ = false;
};

// Runs after a leaf's gradient was accumulated into its .grad (torch's
// register_post_accumulate_grad_hook); `leaf` is the leaf, its .grad the sum so far.
using PostAccumulateGradHook = std::function<void(const Tensor& leaf)>;

// Accumulates the incoming gradient into a leaf's .grad, then runs its post-accumulate hooks.
// Graphs share one per leaf while any holds it (the leaf keeps only a weak reference), so hooks
// stay on it for as long as the caller of grad_accumulator() keeps the pointer.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::weak_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  std::vector<Tensor> apply(const std::vector<Tensor>& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  void add_post_hook(PostAccumulateGradHook hook) { post_hooks_.push_back(std::move(hook)); }

 private:
  void accumulate(const std::shared_ptr<TensorImpl>& impl, const std::vector<Tensor>& grads);
  std::weak_ptr<TensorImpl> leaf_;
  std::vector<PostAccumulateGradHook> post_hooks_;
};

// The accumulator of a leaf that requires grad (made when it has none; kiln::Error for a
// non-leaf or a tensor that needs no gradient). Holding the pointer keeps it, and its hooks,
// for every later graph over the leaf.
std::shared_ptr<AccumulateGrad> grad_accumulator(const Tensor& leaf);
// Adds a post-accumulate hook to `leaf`; the returned accumulator must be kept for the hook to stay.
std::shared_ptr<AccumulateGrad> register_post_accumulate_grad_hook(const Tensor& leaf, PostAccumulateGradHook hook);

// Queues `fn` to run when the backward running on this thread ends (the outermost one, when
// backwards nest, as activation checkpointing's do), after its last node (torch's
// Variable._execution_engine.queue_callback). kiln::Error outside a backward. Callbacks run in
// queue order; one queued by a callback runs too. When the backward fails they are dropped.
void queue_backward_callback(std::function<void()> fn);
// Whether a backward is running on this thread.
bool in_backward();

// True when grad mode is on and any input requires grad.
bool any_requires_grad(const std::vector<Tensor>& inputs);

// Connects `outputs` to a new FunctionNode over `inputs` when any_requires_grad(inputs).
// The backward returns one gradient per input (undefined where an input needs none).
void record(const std::string& op, const std::vector<Tensor>& inputs, const std::vector<Tensor*>& outputs,
            BackwardFn backward);
inline void record(const std::string& op, const std::vector<Tensor>& inputs, Tensor& output, BackwardFn backward) {
  record(op, inputs, std::vector<Tensor*>{&output}, std::move(backward));
}

// Runs backward from `roots` with the given output gradients: each defined, with its root's
// shape, dtype and device (checked: an error names the gradient).
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph);

}  // namespace kiln
