// Activation checkpointing (torch.utils.checkpoint): a function of one tensor runs without
// keeping its activations, and its backward runs it again to get them. The trainer's
// --checkpoint-activations block|mlp wraps each Llama decoder block (or its MLP) in it
// (LlamaConfig::checkpoint_activations). The recomputation takes the same ops on the same
// inputs, so (with deterministic kernels) the gradients are bitwise those of the plain step.
#pragma once
#include <functional>

#include "kiln/core/tensor.h"

namespace kiln::nn {

using CheckpointFn = std::function<Tensor(const Tensor&)>;

// fn(x) computed without recording history; one node "checkpoint" records it. Its backward
// runs fn on a detached copy of x with grad mode on and back-propagates the output's gradient
// through that: the parameters fn reads receive their gradients then (into their .grad, as
// any backward gives them), and x's gradient flows on. fn must be a pure function of x and of
// what it captures (no randomness, nothing changed in between); it is kept, with what it
// captures, until the backward has run. Outside grad mode, or when x needs no gradient (the
// recomputation's only way back into the graph), it is fn(x).
Tensor checkpoint(const CheckpointFn& fn, const Tensor& x);

}  // namespace kiln::nn
