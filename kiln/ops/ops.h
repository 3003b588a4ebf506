// The public ops of kiln: factories, elementwise math with broadcasting, reductions, matrix
// products, and the neural-network ops a Llama-style decoder needs. Every op checks its
// arguments (kiln::Error names the op, the argument and the values), records autograd
// history when an input requires grad, and dispatches to kernels/cpu or kernels/cuda.
// Binary ops need equal dtypes and devices (no implicit promotion).
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/core/tensor.h"

namespace kiln {

// ---- factories (kiln/ops/factories.cpp) ----
Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor ones(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, Device device = kCPU);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor empty_like(const Tensor& t);
// Uninitialised, `shape`, its dims laid out in memory in the order of `like`'s strides (largest
// outermost; ties in order): dense, as a tensor with those strides would be if it were dense
// (a gradient in its input's layout, e.g. [B, H, T, D] stored as [B, T, H, D]).
Tensor empty_in_layout(const Shape& shape, const Strides& like, DType dtype, Device device);
Tensor arange(double start, double end, double step = 1.0, DType dtype = DType::i64, Device device = kCPU);
inline Tensor arange(int64_t end, DType dtype = DType::i64, Device device = kCPU) {
  return arange(0.0, static_cast<double>(end), 1.0, dtype, device);
}
// Uniform in [0, 1) and standard normal, from a counter-based generator: the same numbers on
// CPU and CUDA for the same generator state. Each call advances the generator.
Tensor rand(const Shape& shape, Generator& gen, DType dtype = DType::f32, Device device = kCPU);
Tensor randn(const Shape& shape, Generator& gen, DType dtype = DType::f32, Device device = kCPU);
// A tensor holding a copy of `values` with the given shape.
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = kCPU);
Tensor scalar_tensor(double value, DType dtype = DType::f32, Device device = kCPU);

// ---- elementwise (kiln/ops/elementwise.cpp) ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
// maximum, minimum: NaN propagates; gradients as PyTorch (ties half and half, NaN to both).
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor rsqrt(const Tensor& a);
Tensor tanh(const Tensor& a);
Tensor sigmoid(const Tensor& a);
Tensor silu(const Tensor& a);
Tensor gelu(const Tensor& a, bool tanh_approximation = false);
Tensor abs(const Tensor& a);
Tensor relu(const Tensor& a);  // NaN stays NaN (as torch)
// Comparisons give bool tensors (no gradient).
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b);
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, double b) { return add(a, -b); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
inline Tensor operator/(const Tensor& a, double b) { return mul(a, 1.0 / b); }

// In place, without autograd (optimizers, initialisation): a += alpha * b, a *= s.
Tensor& add_(Tensor& a, const Tensor& b, double alpha = 1.0);
Tensor& mul_(Tensor& a, double s);

// The broadcast shape of a and b, or kiln::Error naming `op`.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Sums `grad` down to `shape` (the inverse of broadcasting), for backward formulas.
Tensor sum_to(const Tensor& grad, const Shape& shape);

// ---- reductions (kiln/ops/reduce.cpp); dims may be negative; empty dims = all ----
// sum: integer and bool inputs give i64 (as in PyTorch).
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// mean, softmax, log_softmax: 16-bit inputs compute in f32 and round once (as PyTorch).
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor amax(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
struct ValuesIndices {
  Tensor values;
  Tensor indices;  // i64
};
// Max along one dim with the (first) index of the maximum.
ValuesIndices max(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor softmax(const Tensor& a, int64_t dim);
Tensor log_softmax(const Tensor& a, int64_t dim);

// ---- matrix products (kiln/ops/matmul.cpp); 16-bit inputs accumulate in f32 ----
// a [..., m, k] @ b [..., k, n] with broadcast batch dims; 1-D operands as in numpy.
Tensor matmul(const Tensor& a, const Tensor& b);
// x [..., in] · weight [out, in]ᵀ + bias [out]
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// ---- batched copies (kiln/ops/copy.cpp) ----
// dsts[i].copy_(srcs[i]) for every i, with copy_'s rules and version bumps, as one batched
// kernel where a pair allows it (same dtype and device, each side contiguous or 2-D with
// contiguous rows: CPU one parallel pass over every pair, CUDA one 2-D memcpy each), else
// copy_ for that pair. FSDP's copy-in and copy-out. No destination may overlap a source.
void copy_many(const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs);

// ---- shape ops (kiln/ops/shape.cpp) ----
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim);
std::vector<Tensor> split(const Tensor& a, int64_t split_size, int64_t dim);
std::vector<Tensor> split(const Tensor& a, const std::vector<int64_t>& sizes, int64_t dim);

// ---- neural-network ops (kiln/ops/nn.cpp) ----
// Waits for the work queued on `device`'s current stream (nothing on the CPU) and raises the
// failure of a range check that ran on the device (an embedding id or a target out of range,
// kiln/ops/index_check.h) as kiln::Error: torch.cuda.synchronize with its device-side asserts.
void synchronize(Device device);
// weight [V, d], ids (i64/i32) of any shape → [..., d]; backward deterministic.
Tensor embedding(const Tensor& weight, const Tensor& ids);
// x [..., d] / rms(x) * weight [d]; fused forward and backward.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
// silu(gate) · up (the Llama MLP's SwiGLU), fused forward and backward; gate and up of one
// shape and dtype. Saves gate and up for the backward.
Tensor swiglu(const Tensor& gate, const Tensor& up);
// Rotary embedding, rotate-half convention (Hugging Face Llama): x [B, H, T, D],
// cos/sin [T, D] (or broadcastable to x). out = x * cos + rotate_half(x) * sin.
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin);
// cos/sin tables [T, D] for positions 0..T-1 (f32), as Llama computes them.
std::pair<Tensor, Tensor> rotary_tables(int64_t seq_len, int64_t head_dim, double theta, Device device = kCPU);

enum class Reduction { none, mean, sum };
Reduction parse_reduction(const std::string& s);
// kiln::Error naming `op` unless r is none, mean or sum (an integer cast to Reduction may be neither).
void check_reduction(Reduction r, const char* op);
struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::mean;
  double label_smoothing = 0.0;
};
// logits [N, C], target [N] (i64/i32) — the unfused reference loss (log_softmax + gather).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options = {});
// Zeroes each element with probability p and scales the rest by 1/(1-p); identity when !training.
Tensor dropout(const Tensor& x, double p, Generator& gen, bool training = true);

}  // namespace kiln
