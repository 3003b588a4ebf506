// Node: one step of the backward graph. An op that records history makes a FunctionNode whose
// backward closure maps the gradients of its outputs to the gradients of its inputs; edges
// lead to the nodes that produced those inputs (or to the accumulator of a leaf: AccumulateGrad,
// with recording and the engine that runs the graph, is kiln/ops/backward.h's, a layer up, since
// they sum and cast gradients with ops). SavedTensor keeps a tensor for backward together with
// its version at save time, so that an in-place edit in between makes backward fail with a
// clear message. Bodies in autograd/graph.cpp.
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
  virtual ~Node();  // frees long chains iteratively (graph.cpp)
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

// True when grad mode is on and any input requires grad.
bool any_requires_grad(const std::vector<Tensor>& inputs);

}  // namespace kiln
