// CUDA bodies of the neural-network kernels (kernels/nn.h): embedding gather and a
// deterministic scatter-add (stable radix sort of positions by id, one owner per id segment),
// fused RMSNorm forward/backward (dweight from per-block partials summed in a fixed order),
// rotary embedding, cross-entropy rows (one block per row), dropout mask (Philox, same bits as
// the CPU) and the index range check. No float atomics anywhere: results are bitwise
// reproducible. 16-bit and f32 inputs accumulate in f32 (fixed tree order), f64 in f64.
#include <cub/cub.cuh>

#include <type_traits>

#include "kiln/core/profile.h"
#include "kiln/core/rng.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/nn.h"
#include "kiln/kernels/timing.h"

namespace kiln::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // a power of two (block_reduce relies on it)

template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

// stream() and KILN_CUDA_CHECK* come from cuda/context.h (namespace kiln::kernels::cuda).
cudaStream_t stream_of(const Tensor& t) { return stream(t.device().index); }

unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

// Fixed-order tree reduction over a block; all threads get the result.
template <class A, bool Max>
__device__ A block_reduce(A v, A* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      A o = sh[threadIdx.x + s];
      sh[threadIdx.x] = Max ? (o > sh[threadIdx.x] ? o : sh[threadIdx.x]) : sh[threadIdx.x] + o;
    }
    __syncthreads();
  }
  A r = sh[0];
  __syncthreads();
  return r;
}

// ---- index check ----

template <class I>
__global__ void range_check_kernel(const I* ids, int64_t n, int64_t lo, int64_t hi, int64_t ignore,
                                   unsigned long long* first) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t v = static_cast<int64_t>(ids[i]);
    if ((v < lo || v >= hi) && v != ignore) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

// Records the first failure of a deferred check (stream order: after range_check_kernel).
template <class I>
__global__ void range_commit_kernel(const unsigned long long* first, const I* ids,
                                    DeviceContext::IndexError* err, unsigned int check) {
  const unsigned long long f = *first;
  if (f != ~0ull && err->set == 0) {
    err->check = check;
    err->pos = static_cast<long long>(f);
    err->value = static_cast<long long>(ids[f]);
    __threadfence_system();
    err->set = 1;
    __threadfence_system();
  }
}

// ---- embedding ----

// Out-of-range ids (the range check is deferred, defer_range_check) read nothing: NaN rows.
template <class T, class I>
__global__ void embedding_forward_kernel(T* out, const T* w, const I* ids, int64_t n, int64_t d, int64_t v) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n * d;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t i = k / d, c = k % d;
    const int64_t id = static_cast<int64_t>(ids[i]);
    out[k] = id >= 0 && id < v ? w[id * d + c] : T(NAN);
  }
}

// Block x = one sorted position; only the first position of each id's segment works: it sums
// the segment's gradient rows in position order and owns that id's row of dweight.
template <class T>
__global__ void embedding_segment_kernel(T* dw, const T* g, const int64_t* keys, const int64_t* pos, int64_t n,
                                         int64_t d, int64_t v) {
  const int64_t i = blockIdx.x;
  if (i > 0 && keys[i] == keys[i - 1]) return;
  const int64_t id = keys[i];
  if (id < 0 || id >= v) return;  // out of range (deferred check): no row to write
  const int64_t c = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= d) return;
  Acc<T> acc = 0;
  for (int64_t j = i; j < n && keys[j] == id; ++j) acc += static_cast<Acc<T>>(g[pos[j] * d + c]);
  dw[id * d + c] = T(acc);
}

template <class I>
__global__ void to_i64_iota_kernel(int64_t* keys, int64_t* pos, const I* ids, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[i] = static_cast<int64_t>(ids[i]);
    pos[i] = i;
  }
}

// ---- rms_norm ----

template <class T>
__global__ void rms_norm_forward_kernel(T* y, Acc<T>* rstd, const T* x, const T* w, int64_t d, double eps) {
  using A = Acc<T>;
  __shared__ A sh[kThreads];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * d;
  A ss = 0;
  for (int64_t c = threadIdx.x; c < d; c += kThreads) {
    A v = static_cast<A>(xr[c]);
    ss += v * v;
  }
  ss = block_reduce<A, false>(ss, sh);
  A rs = A(1) / sqrt(ss / static_cast<A>(d) + static_cast<A>(eps));
  if (threadIdx.x == 0) rstd[r] = rs;
  for (int64_t c = threadIdx.x; c < d; c += kThreads) y[r * d + c] = T(static_cast<A>(xr[c]) * rs * static_cast<A>(w[c]));
}

// Block b handles rows [b*rows/G, (b+1)*rows/G): writes dx and its partial dweight row.
template <class T>
__global__ void rms_norm_backward_kernel(T* dx, Acc<T>* partial, const T* dy, const T* x, const T* w,
                                         const Acc<T>* rstd, int64_t rows, int64_t d) {
  using A = Acc<T>;
  __shared__ A sh[kThreads];
  const int64_t g = gridDim.x, b = blockIdx.x;
  const int64_t r0 = rows * b / g, r1 = rows * (b + 1) / g;
  if (partial)
    for (int64_t c = threadIdx.x; c < d; c += kThreads) partial[b * d + c] = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * d;
    const T* gr = dy + r * d;
    const A rs = rstd[r];
    A dot = 0;
    for (int64_t c = threadIdx.x; c < d; c += kThreads)
      dot += static_cast<A>(gr[c]) * static_cast<A>(w[c]) * static_cast<A>(xr[c]);
    dot = block_reduce<A, false>(dot, sh);
    const A k = dot * rs * rs * rs / static_cast<A>(d);
    for (int64_t c = threadIdx.x; c < d; c += kThreads) {
      A xc = static_cast<A>(xr[c]), gc = static_cast<A>(gr[c]);
      dx[r * d + c] = T(gc * static_cast<A>(w[c]) * rs - xc * k);
      if (partial) partial[b * d + c] += gc * xc * rs;  // column c is owned by one thread
    }
  }
}

template <class T>
__global__ void column_sum_kernel(T* out, const Acc<T>* partial, int64_t g, int64_t d) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= d) return;
  Acc<T> s = 0;
  for (int64_t b = 0; b < g; ++b) s += partial[b * d + c];
  out[c] = T(s);
}

// ---- rotary ----

template <class T>
__global__ void rotary_kernel(T* y, const T* x, const float* cs, const float* sn, int64_t total, int64_t t,
                              int64_t d, bool transpose) {
  using A = Acc<T>;
  const int64_t half = d / 2;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = k % d, pos = (k / d) % t, base = k - c;
    const float* cr = cs + pos * d;
    const float* sr = sn + pos * d;
    A v = static_cast<A>(x[k]) * static_cast<A>(cr[c]);
    if (!transpose)
      v += c < half ? -static_cast<A>(x[base + c + half]) * static_cast<A>(sr[c])
                    : static_cast<A>(x[base + c - half]) * static_cast<A>(sr[c]);
    else
      v += c < half ? static_cast<A>(x[base + c + half]) * static_cast<A>(sr[c + half])
                    : -static_cast<A>(x[base + c - half]) * static_cast<A>(sr[c - half]);
    y[k] = T(v);
  }
}

// ---- cross entropy ----

template <class T, class I>
__global__ void cross_entropy_forward_kernel(Acc<T>* loss, Acc<T>* lse, const T* x, const I* target, int64_t c,
                                             int64_t ignore, double ls) {
  using A = Acc<T>;
  __shared__ A sh[kThreads];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * c;
  A m = -INFINITY;
  for (int64_t k = threadIdx.x; k < c; k += kThreads) m = fmax(m, static_cast<A>(xr[k]));
  m = block_reduce<A, true>(m, sh);
  A s = 0, sx = 0;
  for (int64_t k = threadIdx.x; k < c; k += kThreads) {
    A v = static_cast<A>(xr[k]);
    s += exp(v - m);
    sx += v;
  }
  s = block_reduce<A, false>(s, sh);
  sx = ls > 0 ? block_reduce<A, false>(sx, sh) : A(0);
  if (threadIdx.x != 0) return;
  const A l = m + log(s);
  lse[r] = l;
  const int64_t tg = static_cast<int64_t>(target[r]);
  if (tg == ignore) {
    loss[r] = 0;
    return;
  }
  if (tg < 0 || tg >= c) {  // out of range (the check is deferred): no read, NaN loss
    loss[r] = A(NAN);
    return;
  }
  const A lsA = static_cast<A>(ls);
  loss[r] = (A(1) - lsA) * (l - static_cast<A>(xr[tg])) + (ls > 0 ? lsA * (l - sx / static_cast<A>(c)) : A(0));
}

template <class T, class I>
__global__ void cross_entropy_backward_kernel(T* dl, const Acc<T>* scale, const T* x, const I* target,
                                              const Acc<T>* lse, int64_t n, int64_t c, int64_t ignore, double ls) {
  using A = Acc<T>;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n * c;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / c, col = k % c;
    const int64_t tg = static_cast<int64_t>(target[r]);
    const A s = tg == ignore ? A(0) : scale[r];
    const A p = exp(static_cast<A>(x[k]) - lse[r]);
    const A v = p - (col == tg ? A(1) - static_cast<A>(ls) : A(0)) - static_cast<A>(ls) / static_cast<A>(c);
    dl[k] = T(s * v);
  }
}

// ---- dropout ----

__global__ void dropout_mask_kernel(bool* keep, int64_t n, uint64_t seed, uint64_t offset, float p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    keep[i] = uniform_from_bits(philox_element(seed, offset, static_cast<uint64_t>(i)).v[0]) >= p;
}

}  // namespace

int64_t first_out_of_range(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore) {
  const int64_t n = ids.numel();
  if (n == 0) return -1;
  cudaStream_t s = stream_of(ids);
  Tensor flag = Tensor::empty({1}, DType::i64, ids.device());
  KILN_CUDA_CHECK(cudaMemsetAsync(flag.data_ptr(), 0xff, sizeof(unsigned long long), s));
  dispatch_index(ids.dtype(), "ids", [&]<class I>() {
    range_check_kernel<I><<<blocks_for(n), kThreads, 0, s>>>(static_cast<const I*>(ids.data_ptr()), n, lo, hi, ignore,
                                                             static_cast<unsigned long long*>(flag.data_ptr()));
  });
  KILN_CUDA_CHECK_LAUNCH("first_out_of_range");
  unsigned long long first = 0;
  profile::count_sync("first_out_of_range");
  KILN_CUDA_CHECK(cudaMemcpyAsync(&first, flag.data_ptr(), sizeof(first), cudaMemcpyDeviceToHost, s));
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
  return first == ~0ull ? -1 : static_cast<int64_t>(first);
}

void defer_range_check(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore, const std::string& what,
                       const std::string& tail) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  const int device = ids.device().index;
  DeviceContext& ctx = context(device);
  if (!ctx.index_error) {
    void* h = nullptr;
    KILN_CUDA_CHECK(cudaHostAlloc(&h, sizeof(DeviceContext::IndexError), cudaHostAllocMapped));
    ctx.index_error = static_cast<DeviceContext::IndexError*>(h);
    *ctx.index_error = DeviceContext::IndexError{0, 0, 0, 0};
  }
  // Bound the host-side list when nothing synchronises for a long time.
  if (ctx.index_checks.size() >= 4096) synchronize(device);
  DeviceContext::IndexError* derr = nullptr;
  KILN_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&derr), ctx.index_error, 0));
  cudaStream_t s = ctx.stream;
  Tensor flag = Tensor::empty({1}, DType::i64, ids.device());
  KILN_CUDA_CHECK(cudaMemsetAsync(flag.data_ptr(), 0xff, sizeof(unsigned long long), s));
  const unsigned int check = static_cast<unsigned int>(ctx.index_checks.size());
  dispatch_index(ids.dtype(), "ids", [&]<class I>() {
    auto* f = static_cast<unsigned long long*>(flag.data_ptr());
    range_check_kernel<I><<<blocks_for(n), kThreads, 0, s>>>(static_cast<const I*>(ids.data_ptr()), n, lo, hi, ignore, f);
    range_commit_kernel<I><<<1, 1, 0, s>>>(f, static_cast<const I*>(ids.data_ptr()), derr, check);
  });
  KILN_CUDA_CHECK_LAUNCH("defer_range_check");
  ctx.index_checks.push_back({what, tail});
}

void check_deferred_errors(int device) {
  DeviceContext& ctx = context(device);
  if (ctx.index_checks.empty()) return;
  std::vector<DeviceContext::IndexCheck> checks;
  checks.swap(ctx.index_checks);
  volatile DeviceContext::IndexError* e = ctx.index_error;
  if (!e || e->set == 0) return;
  const unsigned int c = e->check;
  const long long pos = e->pos, value = e->value;
  e->set = 0;
  KILN_CHECK(c < checks.size(), "deferred index check: bad record ", c);
  fail(checks[c].what, "[", pos, "]=", value, checks[c].tail);
}

void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& ids) {
  const int64_t n = ids.numel(), d = weight.size(1);
  cudaStream_t s = stream_of(out);
  dispatch_floating(weight.dtype(), "embedding", [&]<class T>() {
    dispatch_index(ids.dtype(), "embedding", [&]<class I>() {
      embedding_forward_kernel<T, I><<<blocks_for(n * d), kThreads, 0, s>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(weight.data_ptr()),
          static_cast<const I*>(ids.data_ptr()), n, d, weight.size(0));
    });
  });
  KILN_CUDA_CHECK_LAUNCH("embedding_forward");
}

void embedding_backward(const Tensor& dweight, const Tensor& grad, const Tensor& ids) {
  const int64_t n = ids.numel(), v = dweight.size(0), d = dweight.size(1);
  cudaStream_t s = stream_of(dweight);
  KILN_CUDA_CHECK(cudaMemsetAsync(dweight.data_ptr(), 0, dweight.nbytes(), s));
  if (n == 0 || d == 0) return;
  Device dev = dweight.device();
  Tensor keys_in = Tensor::empty({n}, DType::i64, dev), pos_in = Tensor::empty({n}, DType::i64, dev);
  Tensor keys = Tensor::empty({n}, DType::i64, dev), pos = Tensor::empty({n}, DType::i64, dev);
  dispatch_index(ids.dtype(), "embedding_backward", [&]<class I>() {
    to_i64_iota_kernel<I><<<blocks_for(n), kThreads, 0, s>>>(keys_in.data<int64_t>(), pos_in.data<int64_t>(),
                                                              static_cast<const I*>(ids.data_ptr()), n);
  });
  KILN_CUDA_CHECK_LAUNCH("embedding_backward (keys)");
  int end_bit = 1;
  while (end_bit < 63 && (int64_t{1} << end_bit) < v) ++end_bit;
  size_t temp_bytes = 0;
  KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in.data<int64_t>(), keys.data<int64_t>(),
                                                  pos_in.data<int64_t>(), pos.data<int64_t>(), static_cast<int>(n), 0,
                                                  end_bit, s));
  Tensor temp = Tensor::empty({static_cast<int64_t>(temp_bytes)}, DType::u8, dev);
  KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, keys_in.data<int64_t>(),
                                                  keys.data<int64_t>(), pos_in.data<int64_t>(), pos.data<int64_t>(),
                                                  static_cast<int>(n), 0, end_bit, s));
  dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>((d + kThreads - 1) / kThreads));
  dispatch_floating(dweight.dtype(), "embedding_backward", [&]<class T>() {
    embedding_segment_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<T*>(dweight.data_ptr()),
                                                         static_cast<const T*>(grad.data_ptr()), keys.data<int64_t>(),
                                                         pos.data<int64_t>(), n, d, v);
  });
  KILN_CUDA_CHECK_LAUNCH("embedding_backward");
}

void rms_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight, double eps) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  if (rows == 0) return;
  cudaStream_t s = stream_of(x);
  dispatch_floating(x.dtype(), "rms_norm", [&]<class T>() {
    rms_norm_forward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
        static_cast<T*>(out.data_ptr()), static_cast<Acc<T>*>(rstd.data_ptr()), static_cast<const T*>(x.data_ptr()),
        static_cast<const T*>(weight.data_ptr()), d, eps);
  });
  KILN_CUDA_CHECK_LAUNCH("rms_norm_forward");
}

void rms_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                       const Tensor& weight, const Tensor& rstd) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  if (rows == 0) return;
  cudaStream_t s = stream_of(x);
  // The number of blocks depends only on the shape, so the dweight summation order is fixed.
  const int64_t g = std::min<int64_t>(rows, 1024);
  dispatch_floating(x.dtype(), "rms_norm_backward", [&]<class T>() {
    const DType pd = std::is_same_v<T, double> ? DType::f64 : DType::f32;
    Tensor partial = dweight.defined() ? Tensor::empty({g, d}, pd, x.device()) : Tensor();
    Acc<T>* pp = partial.defined() ? static_cast<Acc<T>*>(partial.data_ptr()) : nullptr;
    rms_norm_backward_kernel<T><<<static_cast<unsigned>(g), kThreads, 0, s>>>(
        static_cast<T*>(dx.data_ptr()), pp, static_cast<const T*>(dy.data_ptr()), static_cast<const T*>(x.data_ptr()),
        static_cast<const T*>(weight.data_ptr()), static_cast<const Acc<T>*>(rstd.data_ptr()), rows, d);
    KILN_CUDA_CHECK_LAUNCH("rms_norm_backward");
    if (pp) {
      column_sum_kernel<T><<<static_cast<unsigned>((d + kThreads - 1) / kThreads), kThreads, 0, s>>>(
          static_cast<T*>(dweight.data_ptr()), pp, g, d);
      KILN_CUDA_CHECK_LAUNCH("rms_norm_backward (dweight)");
    }
  });
}

void rotary(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose) {
  const int64_t t = cos.size(0), d = cos.size(1), total = x.numel();
  if (total == 0) return;
  cudaStream_t s = stream_of(x);
  dispatch_floating(x.dtype(), "rotary_embedding", [&]<class T>() {
    rotary_kernel<T><<<blocks_for(total), kThreads, 0, s>>>(static_cast<T*>(out.data_ptr()),
                                                           static_cast<const T*>(x.data_ptr()), cos.data<float>(),
                                                           sin.data<float>(), total, t, d, transpose);
  });
  KILN_CUDA_CHECK_LAUNCH("rotary_embedding");
}

void cross_entropy_forward(const Tensor& loss, const Tensor& lse, const Tensor& logits, const Tensor& target,
                           int64_t ignore_index, double label_smoothing) {
  const int64_t n = logits.size(0), c = logits.size(1);
  if (n == 0) return;
  cudaStream_t s = stream_of(logits);
  dispatch_floating(logits.dtype(), "cross_entropy", [&]<class T>() {
    dispatch_index(target.dtype(), "cross_entropy", [&]<class I>() {
      cross_entropy_forward_kernel<T, I><<<static_cast<unsigned>(n), kThreads, 0, s>>>(
          static_cast<Acc<T>*>(loss.data_ptr()), static_cast<Acc<T>*>(lse.data_ptr()),
          static_cast<const T*>(logits.data_ptr()), static_cast<const I*>(target.data_ptr()), c, ignore_index,
          label_smoothing);
    });
  });
  KILN_CUDA_CHECK_LAUNCH("cross_entropy_forward");
}

void cross_entropy_backward(const Tensor& dlogits, const Tensor& scale, const Tensor& logits, const Tensor& target,
                            const Tensor& lse, int64_t ignore_index, double label_smoothing) {
  const int64_t n = logits.size(0), c = logits.size(1);
  if (n * c == 0) return;
  cudaStream_t s = stream_of(logits);
  dispatch_floating(logits.dtype(), "cross_entropy_backward", [&]<class T>() {
    dispatch_index(target.dtype(), "cross_entropy_backward", [&]<class I>() {
      cross_entropy_backward_kernel<T, I><<<blocks_for(n * c), kThreads, 0, s>>>(
          static_cast<T*>(dlogits.data_ptr()), static_cast<const Acc<T>*>(scale.data_ptr()),
          static_cast<const T*>(logits.data_ptr()), static_cast<const I*>(target.data_ptr()),
          static_cast<const Acc<T>*>(lse.data_ptr()), n, c, ignore_index, label_smoothing);
    });
  });
  KILN_CUDA_CHECK_LAUNCH("cross_entropy_backward");
}

void dropout_mask(const Tensor& keep, uint64_t seed, uint64_t offset, double p) {
  const int64_t n = keep.numel();
  if (n == 0) return;
  cudaStream_t s = stream_of(keep);
  dropout_mask_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<bool*>(keep.data_ptr()), n, seed, offset,
                                                         static_cast<float>(p));
  KILN_CUDA_CHECK_LAUNCH("dropout_mask");
}

}  // namespace kiln::kernels::cuda
