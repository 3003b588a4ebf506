// CUDA bodies of the row reductions (sum, max, max with index) over a contiguous
// [rows, cols] matrix. A row is reduced by one warp (cols <= 512; 8 rows per block) or one
// block of 256 threads: each thread folds the elements c = lane, lane + width, ... in order,
// then a fixed tree (warp shuffles, then the block's warp results) combines them, so results
// are bitwise deterministic. Sums accumulate in f32 (f64 for f64, i64 for integers); max
// propagates NaN like the CPU body (max_rows_index returns the first NaN's position).
#include <cmath>
#include <limits>

#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/reduce.h"

namespace kiln::kernels::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kWarpRowLimit = 512;  // rows up to this many columns get one warp each

template <class A>
__device__ __forceinline__ A shfl_down(A v, int d) {
  if constexpr (std::is_same_v<A, float> || std::is_same_v<A, double> || std::is_same_v<A, int64_t>)
    return __shfl_down_sync(0xffffffffu, v, d);
  else
    return static_cast<A>(__shfl_down_sync(0xffffffffu, static_cast<int>(v), d));
}

template <class A>
__device__ __forceinline__ A lowest() {
  if constexpr (std::is_floating_point_v<A>) return -std::numeric_limits<A>::infinity();
  else return std::numeric_limits<A>::lowest();
}

// Sum or NaN-propagating max: associative and fixed in order.
template <bool IsMax, class A>
__device__ __forceinline__ A combine(A a, A b) {
  if constexpr (IsMax) return (a != a) ? a : ((b != b) ? b : (b > a ? b : a));
  else return a + b;
}

// (value, index) pairs: NaN first (lowest index among NaNs), then larger value, then lower index.
template <class A>
__device__ __forceinline__ void combine_arg(A& v, int64_t& i, A v2, int64_t i2) {
  bool n1 = v != v, n2 = v2 != v2;
  bool take;
  if (n1 || n2) take = n2 && (!n1 || i2 < i);
  else take = v2 > v || (v2 == v && i2 < i);
  if (take) {
    v = v2;
    i = i2;
  }
}

template <class T, class A, bool IsMax>
__global__ void __launch_bounds__(kThreads) reduce_rows_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                               int64_t rows, int64_t cols, int width) {
  __shared__ A partial[kWarps];
  const int lane = threadIdx.x % width;  // position within the row's group
  const int rows_per_block = kThreads / width;
  const int warp = threadIdx.x / 32;
  const A identity = IsMax ? lowest<A>() : A(0);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rows_per_block; base < rows;
       base += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int64_t r = base + threadIdx.x / width;
    A acc = identity;
    if (r < rows) {
      const T* row = x + r * cols;
      for (int64_t c = lane; c < cols; c += width) acc = combine<IsMax>(acc, static_cast<A>(row[c]));
    }
    for (int d = 16; d > 0; d /= 2) acc = combine<IsMax>(acc, shfl_down(acc, d));
    if (width == 32) {
      if (lane == 0 && r < rows) y[r] = T(acc);
    } else {
      if (threadIdx.x % 32 == 0) partial[warp] = acc;
      __syncthreads();
      if (warp == 0) {
        A v = threadIdx.x < kWarps ? partial[threadIdx.x] : identity;
        for (int d = 16; d > 0; d /= 2) v = combine<IsMax>(v, shfl_down(v, d));
        if (threadIdx.x == 0 && r < rows) y[r] = T(v);
      }
      __syncthreads();
    }
  }
}

template <class T, class A>
__global__ void __launch_bounds__(kThreads) max_index_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                             int64_t* __restrict__ idx, int64_t rows, int64_t cols,
                                                             int width) {
  __shared__ A pv[kWarps];
  __shared__ int64_t pi[kWarps];
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  const int lane = threadIdx.x % width;
  const int rows_per_block = kThreads / width;
  const int warp = threadIdx.x / 32;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rows_per_block; base < rows;
       base += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int64_t r = base + threadIdx.x / width;
    A v = lowest<A>();
    int64_t i = kNone;
    if (r < rows) {
      const T* row = x + r * cols;
      for (int64_t c = lane; c < cols; c += width) combine_arg(v, i, static_cast<A>(row[c]), c);
    }
    for (int d = 16; d > 0; d /= 2) {
      A v2 = shfl_down(v, d);
      int64_t i2 = shfl_down(i, d);
      combine_arg(v, i, v2, i2);
    }
    bool write = false;
    if (width == 32) {
      write = lane == 0 && r < rows;
    } else {
      if (threadIdx.x % 32 == 0) {
        pv[warp] = v;
        pi[warp] = i;
      }
      __syncthreads();
      if (warp == 0) {
        v = threadIdx.x < kWarps ? pv[threadIdx.x] : lowest<A>();
        i = threadIdx.x < kWarps ? pi[threadIdx.x] : kNone;
        for (int d = 16; d > 0; d /= 2) {
          A v2 = shfl_down(v, d);
          int64_t i2 = shfl_down(i, d);
          combine_arg(v, i, v2, i2);
        }
        write = threadIdx.x == 0 && r < rows;
      }
      __syncthreads();
    }
    if (write) {
      y[r] = x[r * cols + i];  // the element itself, as the CPU body writes it
      idx[r] = i;
    }
  }
}

struct Launch {
  int width;
  unsigned blocks;
};
Launch launch_shape(int64_t rows, int64_t cols) {
  Launch l;
  l.width = cols <= kWarpRowLimit ? 32 : kThreads;
  int64_t per_block = kThreads / l.width;
  int64_t blocks = (rows + per_block - 1) / per_block;
  l.blocks = static_cast<unsigned>(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));
  return l;
}

void check_input(const Tensor& out, const Tensor& in, const char* op) {
  KILN_CHECK(out.is_cuda() && in.device() == out.device(), op, ": expected CUDA tensors on one device, got ",
             in.device().str(), " and ", out.device().str());
  KILN_CHECK(in.is_contiguous() && out.is_contiguous(), op, ": reduction kernel needs contiguous tensors");
}

}  // namespace

void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& in) {
  check_input(out, in, op == ReduceOp::sum ? "sum" : "amax");
  const int64_t rows = out.numel();
  const int64_t cols = rows ? in.numel() / rows : 0;
  if (rows == 0) return;
  KILN_CHECK(op == ReduceOp::sum || cols > 0, "amax: cannot reduce over an empty dimension");
  cudaStream_t stream = cuda::stream(out.device().index);
  Launch l = launch_shape(rows, cols);
  dispatch_all(in.dtype(), "reduce", [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("sum/max: reductions over bool tensors are not supported");
    } else {
      const T* x = static_cast<const T*>(in.data_ptr());
      T* y = static_cast<T*>(out.data_ptr());
      if (op == ReduceOp::sum) {
        using A = std::conditional_t<std::is_floating_point_v<acc_t<T>>, acc_t<T>, int64_t>;
        reduce_rows_kernel<T, A, false><<<l.blocks, kThreads, 0, stream>>>(x, y, rows, cols, l.width);
      } else {
        reduce_rows_kernel<T, acc_t<T>, true><<<l.blocks, kThreads, 0, stream>>>(x, y, rows, cols, l.width);
      }
      KILN_CUDA_CHECK_LAUNCH("reduce_rows");
    }
  });
}

void max_rows_index(const Tensor& values, const Tensor& indices, const Tensor& in) {
  check_input(values, in, "max");
  KILN_CHECK(indices.dtype() == DType::i64 && indices.device() == values.device() && indices.is_contiguous(),
             "max: indices must be contiguous i64 on ", values.device().str());
  const int64_t rows = values.numel();
  const int64_t cols = rows ? in.numel() / rows : 0;
  KILN_CHECK(cols > 0 || rows == 0, "max: cannot reduce over an empty dimension");
  if (rows == 0) return;
  cudaStream_t stream = cuda::stream(values.device().index);
  Launch l = launch_shape(rows, cols);
  dispatch_all(in.dtype(), "max", [&]<class T>() {
    using A = std::conditional_t<std::is_same_v<T, bool>, int, acc_t<T>>;
    max_index_kernel<T, A><<<l.blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(in.data_ptr()), static_cast<T*>(values.data_ptr()),
        static_cast<int64_t*>(indices.data_ptr()), rows, cols, l.width);
    KILN_CUDA_CHECK_LAUNCH("max_rows_index");
  });
}

}  // namespace kiln::kernels::cuda
