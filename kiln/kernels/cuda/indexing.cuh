// Strided elementwise launches for CUDA kernels: StridedIndexer<N> maps a flat element index
// of a shape to the element offsets of N operands (each with its own strides, 0 for broadcast
// dims), with sizes and strides passed by value (up to kMaxDims dims after coalescing) and
// 64-bit index math. The rank is a run-time value, so one kernel serves every rank.
// launch_elementwise<N>(shape, {strides...}, f, stream) runs f(offsets) for every element,
// with a flat fast path (offsets all equal to the index) when every operand is contiguous.
// `f` is a functor struct with `__device__ void operator()(const int64_t* off) const`.
#pragma once
#include <array>
#include <cstdint>

#include "kiln/core/error.h"
#include "kiln/core/tensor.h"
#include "kiln/kernels/cuda/context.h"

namespace kiln::kernels::cuda {

inline constexpr int kMaxDims = 8;
inline constexpr int kElementwiseThreads = 256;

template <int N>
struct StridedIndexer {
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};

  // Offsets of element `i` (row-major order over sizes).
  __device__ __forceinline__ void offsets(int64_t i, int64_t* off) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      int64_t s = sizes[d];
      int64_t idx = i % s;
      i /= s;
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += idx * strides[k][d];
    }
  }
};

// Builds the indexer for `shape` with each operand's strides: drops size-1 dims and merges
// neighbouring dims that are contiguous with each other in every operand. Returns whether all
// operands are plain contiguous (flat index == offset).
template <int N>
bool make_indexer(const Shape& shape, const std::array<const Strides*, N>& strides, StridedIndexer<N>& ix) {
  int64_t sz[64];
  int64_t st[N][64];
  int nd = 0;
  KILN_CHECK(shape.size() <= 64, "cuda elementwise: too many dimensions (", shape.size(), ")");
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    sz[nd] = shape[d];
    for (int k = 0; k < N; ++k) st[k][nd] = (*strides[k])[d];
    ++nd;
  }
  // Merge dim d into d-1 when stride[d-1] == stride[d] * size[d] for every operand.
  int m = 0;
  for (int d = 0; d < nd; ++d) {
    bool merge = m > 0;
    for (int k = 0; k < N && merge; ++k) merge = st[k][m - 1] == st[k][d] * sz[d];
    if (merge) {
      sz[m - 1] *= sz[d];
      for (int k = 0; k < N; ++k) st[k][m - 1] = st[k][d];
    } else {
      sz[m] = sz[d];
      for (int k = 0; k < N; ++k) st[k][m] = st[k][d];
      ++m;
    }
  }
  KILN_CHECK(m <= kMaxDims, "cuda elementwise: ", m, " dimensions after coalescing (at most ", kMaxDims,
             " supported), shape ", shape);
  ix.ndim = m;
  bool contiguous = true;
  for (int d = 0; d < m; ++d) {
    ix.sizes[d] = sz[d];
    for (int k = 0; k < N; ++k) ix.strides[k][d] = st[k][d];
  }
  // After coalescing, all-contiguous means one dim (or none) with unit strides.
  if (m > 1) contiguous = false;
  for (int k = 0; k < N && m == 1; ++k) contiguous = contiguous && st[k][0] == 1;
  return contiguous;
}

// One kernel for both layouts (a uniform branch), to halve the instantiations.
template <int N, class F>
__global__ void __launch_bounds__(kElementwiseThreads)
    elementwise_kernel(int64_t n, bool contiguous, StridedIndexer<N> ix, F f) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t off[N];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    if (contiguous) {
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] = i;
    } else {
      ix.offsets(i, off);
    }
    f(off);
  }
}

// Grid size for n elements: enough blocks to fill the GPU a few times over, grid-stride beyond.
inline unsigned elementwise_blocks(int64_t n) {
  int64_t blocks = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

template <int N, class F>
void launch_elementwise(const Shape& shape, const std::array<const Strides*, N>& strides, const F& f,
                        cudaStream_t stream, const char* name) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  StridedIndexer<N> ix;
  const bool contiguous = make_indexer<N>(shape, strides, ix);
  elementwise_kernel<N, F><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(n, contiguous, ix, f);
  KILN_CUDA_CHECK_LAUNCH(name);
}

}  // namespace kiln::kernels::cuda
