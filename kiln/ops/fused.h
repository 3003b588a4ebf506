// Ops fused for memory: swiglu_linear is linear(swiglu(gate, up), weight) (the Llama MLP's down
// projection of silu(gate) · up) without keeping the product for the backward: it saves gate and
// up (which swiglu's backward needs anyway) and recomputes the product there, with the same
// kernel, so the gradients are the unfused pair's bits (Fused.SwigluLinearGivesTheUnfusedBits).
// The product is tokens × intermediate elements a layer: at the 1.5 B model in bf16, 134 MB a
// layer of the activations a step holds. The Llama MLP uses it on CUDA only (nn/llama.cpp says why).
#pragma once
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln {

// gate, up: [..., in] (one floating dtype, one device, the same shape); weight: [out, in].
// Returns [..., out]. Defined in ops/matmul.cpp (beside linear).
Tensor swiglu_linear(const Tensor& gate, const Tensor& up, const Tensor& weight);

namespace detail {
// swiglu's gradients {d gate, d up} for the output gradient `dout` (contiguous, gate's shape) from
// the saved contiguous gate and up: the one kernel call that swiglu's node (ops/nn.cpp) and
// swiglu_linear's make. Defined in ops/nn.cpp.
std::vector<Tensor> swiglu_grads(const Tensor& dout, const Tensor& gate, const Tensor& up);
}  // namespace detail

}  // namespace kiln
