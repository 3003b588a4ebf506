// RMSNorm at memory speed on CUDA (bodies in rmsnorm.cu; a CPU-only build's rmsnorm_stub.cpp
// declines everything): forward, backward (dx and a deterministic dweight) and the forward fused
// with the residual add of a Llama block (h = x + residual; out = rmsnorm(h) · weight).
// A block per row (the backward: a persistent grid, a fixed number of blocks per SM), the row in
// registers as 16-byte vectors, f32 statistics, block reductions in a fixed order; dweight from
// one f32 partial per block, summed over the blocks in block order by a second kernel (no
// atomics: bits equal run to run on one machine). Plain C++ header.
//
// The fast kernels apply to f32, bf16 and f16 rows of d elements with d·itemsize a multiple of 16
// bytes, d ≤ 2048 vectors (16384 bf16 or 8192 f32 elements), contiguous tensors with 16-byte aligned bases;
// forward / backward return false (having done nothing) otherwise, and the caller runs the
// general kernels of kernels/cuda/nn.cu. rstd is f32 [rows] = 1 / sqrt(mean(x²) + eps).
#pragma once
#include "kiln/core/tensor.h"

namespace kiln::kernels::cuda::rmsnorm {

// Whether the fast kernels take rows of d elements of dtype t.
bool applies(DType t, int64_t d);

// out [rows, d] = x · rstd · weight; rstd [rows] f32.
bool forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight, double eps);

// dx = rstd · (dy·w) − x · rstd³ · mean(dy·w·x) (+ dh_extra, the gradient reaching h by its other
// use, when defined); dweight [d] (weight's dtype; undefined: skipped) = Σ_rows dy · x · rstd.
bool backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x, const Tensor& weight,
              const Tensor& rstd, const Tensor& dh_extra = Tensor());

// h = x + residual (stored in x's dtype, rounded once), out = rmsnorm(h) · weight, rstd of h.
// An error where the fast kernels do not apply (the message says why).
void add_forward(const Tensor& h, const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& residual,
                 const Tensor& weight, double eps);

}  // namespace kiln::kernels::cuda::rmsnorm
