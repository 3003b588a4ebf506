// CUDA bodies of the neural-network kernels (kernels/nn.h): embedding gather and a
// deterministic scatter-add (stable radix sort of positions by id, one owner per id segment),
// fused RMSNorm forward/backward (a warp per row; dweight from per-row-group partials summed
// in a fixed order), rotary embedding, cross-entropy rows (one block per row), dropout mask
// (Philox, same bits as the CPU), fused SwiGLU and the index range check. No float atomics
// anywhere: results are bitwise reproducible. 16-bit and f32 inputs accumulate in f32 (fixed tree order), f64 in f64.
#include <algorithm>
#include <cub/cub.cuh>

#include <type_traits>

#include "kiln/core/profile.h"
#include "kiln/core/rng.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/indexing.cuh"
#include "kiln/kernels/cuda/rmsnorm.h"
#include "kiln/kernels/elementwise.h"
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
//
// One warp per row (rows strided over the grid's warps), the row in packs of P elements (P > 1
// where d and the pointers allow): many loads in flight and a shuffle reduction, where a block
// per row (forward) or per row group (backward), with a barrier tree per row, ran at a fraction
// of HBM's bandwidth (the backward at 90 us for an 8192 x 768 bf16 tensor, 38 MB). The xor
// butterfly gives every lane the same sum, in an order fixed by d alone. dweight: per-group
// column partials (the group count fixed by the shape), then column_sum_kernel in group order.

constexpr int kWarpsPerBlock = kThreads / 32;

template <class A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

template <class T, int P>
__global__ void rms_norm_forward_kernel(T* y, Acc<T>* rstd, const T* x, const T* w, int64_t rows, int64_t d,
                                        double eps) {
  using A = Acc<T>;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const T* xr = x + r * d;
    A ss = 0;
    for (int64_t c = lane * P; c < d; c += 32 * P) {
      const Pack<T, P> v = load_pack<P>(xr, c);
#pragma unroll
      for (int k = 0; k < P; ++k) ss += static_cast<A>(v.v[k]) * static_cast<A>(v.v[k]);
    }
    ss = warp_sum(ss);
    const A rs = A(1) / sqrt(ss / static_cast<A>(d) + static_cast<A>(eps));
    if (lane == 0) rstd[r] = rs;
    for (int64_t c = lane * P; c < d; c += 32 * P) {
      const Pack<T, P> v = load_pack<P>(xr, c), wv = load_pack<P>(w, c);
      Pack<T, P> o;
#pragma unroll
      for (int k = 0; k < P; ++k) o.v[k] = T(static_cast<A>(v.v[k]) * rs * static_cast<A>(wv.v[k]));
      store_pack(y + r * d, c, o);
    }
  }
}

template <class T, int P>
__global__ void rms_norm_backward_kernel(T* dx, const T* dy, const T* x, const T* w, const Acc<T>* rstd, int64_t rows,
                                         int64_t d) {
  using A = Acc<T>;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const T* xr = x + r * d;
    const T* gr = dy + r * d;
    const A rs = rstd[r];
    A dot = 0;
    for (int64_t c = lane * P; c < d; c += 32 * P) {
      const Pack<T, P> gv = load_pack<P>(gr, c), wv = load_pack<P>(w, c), xv = load_pack<P>(xr, c);
#pragma unroll
      for (int k = 0; k < P; ++k) dot += static_cast<A>(gv.v[k]) * static_cast<A>(wv.v[k]) * static_cast<A>(xv.v[k]);
    }
    dot = warp_sum(dot);
    const A kk = dot * rs * rs * rs / static_cast<A>(d);
    for (int64_t c = lane * P; c < d; c += 32 * P) {
      const Pack<T, P> gv = load_pack<P>(gr, c), wv = load_pack<P>(w, c), xv = load_pack<P>(xr, c);
      Pack<T, P> o;
#pragma unroll
      for (int k = 0; k < P; ++k)
        o.v[k] = T(static_cast<A>(gv.v[k]) * static_cast<A>(wv.v[k]) * rs - static_cast<A>(xv.v[k]) * kk);
      store_pack(dx + r * d, c, o);
    }
  }
}

// Group blockIdx.y of gridDim.y (rows [rows·y/G, rows·(y+1)/G)), P columns a thread: the
// group's sum of dy ∘ x ∘ rstd per column, in row order.
template <class T, int P>
__global__ void rms_norm_dweight_partials_kernel(Acc<T>* partial, const T* dy, const T* x, const Acc<T>* rstd,
                                                 int64_t rows, int64_t d) {
  using A = Acc<T>;
  const int64_t groups = gridDim.y, y = blockIdx.y;
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * P;
  if (c >= d) return;
  A acc[P] = {};
  for (int64_t r = rows * y / groups; r < rows * (y + 1) / groups; ++r) {
    const A rs = rstd[r];
    const Pack<T, P> gv = load_pack<P>(dy + r * d, c), xv = load_pack<P>(x + r * d, c);
#pragma unroll
    for (int k = 0; k < P; ++k) acc[k] += static_cast<A>(gv.v[k]) * static_cast<A>(xv.v[k]) * rs;
  }
#pragma unroll
  for (int k = 0; k < P; ++k) partial[y * d + c + k] = acc[k];
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

// One thread per V consecutive pairs (c, c + D/2) of a row, c < D/2: both elements are read
// once and both written. Rows are x's and y's leading dims (any strides; D at stride 1 in both,
// so a [B, T, H, D] buffer seen as [B, H, T, D] is read in place, not copied first), mapped to
// offsets by `rows`; a row's position is its flat index modulo T (the innermost leading dim).
// kSmall: fewer than 2^31 elements, so the index math is 32-bit (DivMod32).
template <class T, int V, bool kSmall>
__global__ void rotary_kernel(T* y, const T* x, const float* cs, const float* sn, int64_t units, DivMod32 per_row,
                              DivMod32 tdiv, int64_t t, int64_t d, bool transpose, StridedIndexer<2> rows) {
  using A = Acc<T>;
  const int64_t half = d / 2, upr = half / V;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < units;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t row, pos, off[2];
    if constexpr (kSmall) {
      const uint32_t r = per_row.div(static_cast<uint32_t>(k));
      row = r, pos = r - tdiv.div(r) * static_cast<uint32_t>(t);
      rows.offsets32(r, off);
    } else {
      row = k / upr, pos = row % t;
      rows.offsets(row, off);
    }
    const int64_t c = (k - row * upr) * V;
    const T* xr = x + off[1];
    T* yr = y + off[0];
    const float* cr = cs + pos * d;
    const float* sr = sn + pos * d;
    const Pack<T, V> x1 = load_pack<V>(xr, c), x2 = load_pack<V>(xr, c + half);
    const Pack<float, V> c1 = load_pack<V>(cr, c), c2 = load_pack<V>(cr, c + half);
    const Pack<float, V> s1 = load_pack<V>(sr, c), s2 = load_pack<V>(sr, c + half);
    Pack<T, V> y1, y2;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const A a = static_cast<A>(x1.v[v]), b = static_cast<A>(x2.v[v]);
      A u = a * static_cast<A>(c1.v[v]), w = b * static_cast<A>(c2.v[v]);
      if (!transpose)
        u += -b * static_cast<A>(s1.v[v]), w += a * static_cast<A>(s2.v[v]);
      else
        u += b * static_cast<A>(s2.v[v]), w += -a * static_cast<A>(s1.v[v]);
      y1.v[v] = T(u), y2.v[v] = T(w);
    }
    store_pack(yr, c, y1);
    store_pack(yr, c + half, y2);
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

// ---- swiglu ----
// Through launch_elementwise (kernels/cuda/indexing.cuh), packs included: the forward (Map2)
// reads gate and up once and writes out; the backward reads grad, gate and up once and writes
// dgate and dup (the unfused silu, product and their backwards were five passes each way).

template <class T>
struct SwigluMath {  // for Map2 (indexing.cuh)
  __device__ T operator()(T gv, T uv) const {
    return T(swiglu_math<Acc<T>>(static_cast<Acc<T>>(gv), static_cast<Acc<T>>(uv)));
  }
};

template <class T>
struct SwigluBackward {
  T* dg;
  T* du;
  const T* d;
  const T* g;
  const T* u;
  static constexpr int kVec = pack_elements(sizeof(T));
  __device__ void at(T dv, T gv, T uv, T& a, T& c) const {
    using A = Acc<T>;
    A ga, ua;
    swiglu_grad_math<A>(static_cast<A>(dv), static_cast<A>(gv), static_cast<A>(uv), ga, ua);
    a = T(ga), c = T(ua);
  }
  __device__ void operator()(const int64_t* o) const { at(d[o[2]], g[o[3]], u[o[4]], dg[o[0]], du[o[1]]); }
  bool packable() const {
    return pack_aligned<kVec>(dg) && pack_aligned<kVec>(du) && pack_aligned<kVec>(d) && pack_aligned<kVec>(g) &&
           pack_aligned<kVec>(u);
  }
  __device__ void packed(const int64_t* o) const {
    const Pack<T, kVec> dv = load_pack<kVec>(d, o[2]), gv = load_pack<kVec>(g, o[3]), uv = load_pack<kVec>(u, o[4]);
    Pack<T, kVec> a, c;
#pragma unroll
    for (int k = 0; k < kVec; ++k) at(dv.v[k], gv.v[k], uv.v[k], a.v[k], c.v[k]);
    store_pack(dg, o[0], a);
    store_pack(du, o[1], c);
  }
};

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
  cudaStream_t s = stream(device);
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

void synchronize_and_check(int device) { synchronize(device); }  // timing.cu: also checks

size_t deferred_check_count(int device) { return context(device).index_checks.size(); }

std::vector<std::pair<std::string, std::string>> deferred_checks_since(int device, size_t mark) {
  const std::vector<DeviceContext::IndexCheck>& q = context(device).index_checks;
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t i = mark; i < q.size(); ++i) out.emplace_back(q[i].what, q[i].tail);
  return out;
}

void requeue_deferred_checks(int device, size_t mark, const std::vector<std::pair<std::string, std::string>>& checks) {
  if (checks.empty()) return;
  std::vector<DeviceContext::IndexCheck>& queued = context(device).index_checks;
  // The same records already at those positions (the graph replayed twice with no synchronisation
  // between, as a step's later micro-batches are): both replays' kernels write there, and a
  // failure of either is named right. Nothing to do.
  if (queued.size() == mark + checks.size() &&
      std::equal(checks.begin(), checks.end(), queued.begin() + static_cast<std::ptrdiff_t>(mark),
                 [](const auto& c, const DeviceContext::IndexCheck& q) { return c.first == q.what && c.second == q.tail; }))
    return;
  // Called before the replay is queued: a synchronisation here reports and clears the checks
  // queued before it (their failures named after their own ops), never the replay's.
  if (queued.size() > mark) synchronize(device);  // clears `queued`
  while (queued.size() < mark) queued.push_back({"(no check: a position held for a replayed CUDA graph)", ""});
  KILN_CHECK(queued.size() == mark, "requeue_deferred_checks: ", queued.size(), " checks queued, expected ", mark);
  for (const auto& [what, tail] : checks) queued.push_back({what, tail});
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

namespace {

// Calls f.template operator()<P>() with P = the elements of a 16-byte pack of T when d is a
// multiple of it and every pointer is aligned for it, else P = 1.
template <class T, class F>
void with_row_pack(int64_t d, std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int P = pack_elements(sizeof(T));
  bool packed = d % P == 0;
  for (const void* p : ptrs) packed = packed && pack_aligned<P>(static_cast<const T*>(p));
  if (packed)
    f.template operator()<P>();
  else
    f.template operator()<1>();
}

unsigned row_warp_blocks(int64_t rows) {
  const int64_t b = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(b < 65535 * 16 ? b : 65535 * 16);
}

}  // namespace

void rms_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight, double eps) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  if (rows == 0) return;
  if (rmsnorm::forward(out, rstd, x, weight, eps)) return;  // the fast kernels where they apply
  cudaStream_t s = stream_of(x);
  dispatch_floating(x.dtype(), "rms_norm", [&]<class T>() {
    with_row_pack<T>(d, {out.data_ptr(), x.data_ptr(), weight.data_ptr()}, [&]<int P>() {
      rms_norm_forward_kernel<T, P><<<row_warp_blocks(rows), kThreads, 0, s>>>(
          static_cast<T*>(out.data_ptr()), static_cast<Acc<T>*>(rstd.data_ptr()), static_cast<const T*>(x.data_ptr()),
          static_cast<const T*>(weight.data_ptr()), rows, d, eps);
    });
  });
  KILN_CUDA_CHECK_LAUNCH("rms_norm_forward");
}

void rms_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                       const Tensor& weight, const Tensor& rstd) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  if (rows == 0) return;
  if (rmsnorm::backward(dx, dweight, dy, x, weight, rstd)) return;  // the fast kernels where they apply
  cudaStream_t s = stream_of(x);
  // The number of row groups depends only on the shape, so the dweight summation order is fixed.
  const int64_t groups = std::min<int64_t>(rows, 512);
  dispatch_floating(x.dtype(), "rms_norm_backward", [&]<class T>() {
    const T* pdy = static_cast<const T*>(dy.data_ptr());
    const T* px = static_cast<const T*>(x.data_ptr());
    const auto* prs = static_cast<const Acc<T>*>(rstd.data_ptr());
    with_row_pack<T>(d, {dx.data_ptr(), pdy, px, weight.data_ptr()}, [&]<int P>() {
      rms_norm_backward_kernel<T, P><<<row_warp_blocks(rows), kThreads, 0, s>>>(
          static_cast<T*>(dx.data_ptr()), pdy, px, static_cast<const T*>(weight.data_ptr()), prs, rows, d);
    });
    KILN_CUDA_CHECK_LAUNCH("rms_norm_backward");
    if (!dweight.defined()) return;
    const DType pd = std::is_same_v<T, double> ? DType::f64 : DType::f32;
    Tensor partial = Tensor::empty({groups, d}, pd, x.device());
    auto* pp = static_cast<Acc<T>*>(partial.data_ptr());
    with_row_pack<T>(d, {pdy, px}, [&]<int P>() {
      const int64_t threads_x = (d / P + kThreads - 1) / kThreads;
      rms_norm_dweight_partials_kernel<T, P>
          <<<dim3(static_cast<unsigned>(threads_x), static_cast<unsigned>(groups)), kThreads, 0, s>>>(pp, pdy, px, prs,
                                                                                                   rows, d);
    });
    KILN_CUDA_CHECK_LAUNCH("rms_norm_backward (dweight partials)");
    column_sum_kernel<T><<<static_cast<unsigned>((d + kThreads - 1) / kThreads), kThreads, 0, s>>>(
        static_cast<T*>(dweight.data_ptr()), pp, groups, d);
    KILN_CUDA_CHECK_LAUNCH("rms_norm_backward (dweight)");
  });
}

void rotary(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose) {
  const int64_t t = cos.size(0), d = cos.size(1), total = x.numel();
  if (total == 0) return;
  KILN_CHECK(x.stride(-1) == 1 && out.stride(-1) == 1, "rotary_embedding: the head dim must be contiguous in x and out");
  const Shape lead(x.shape().begin(), x.shape().end() - 1);
  const Strides xs(x.strides().begin(), x.strides().end() - 1), ys(out.strides().begin(), out.strides().end() - 1);
  StridedIndexer<2> rows;
  make_indexer<2>(lead, {&ys, &xs}, rows);
  const bool small = total < (int64_t{1} << 31);
  cudaStream_t s = stream_of(x);
  dispatch_floating(x.dtype(), "rotary_embedding", [&]<class T>() {
    // Packs of 4 pairs where every row and half-row starts aligned for them.
    bool four = (d / 2) % 4 == 0 && pack_aligned<4>(static_cast<const T*>(x.data_ptr())) &&
                pack_aligned<4>(static_cast<const T*>(out.data_ptr())) && pack_aligned<4>(cos.data<float>()) &&
                pack_aligned<4>(sin.data<float>());
    for (int k = 0; k < rows.ndim; ++k) four = four && rows.strides[0][k] % 4 == 0 && rows.strides[1][k] % 4 == 0;
    auto launch = [&]<int V, bool kSmall>() {
      const int64_t units = total / d * (d / 2 / V);
      const DivMod32 per_row(kSmall ? static_cast<uint32_t>(d / 2 / V) : 1), tdiv(kSmall ? static_cast<uint32_t>(t) : 1);
      rotary_kernel<T, V, kSmall><<<blocks_for(units), kThreads, 0, s>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), cos.data<float>(), sin.data<float>(),
          units, per_row, tdiv, t, d, transpose, rows);
    };
    if (four)
      small ? launch.template operator()<4, true>() : launch.template operator()<4, false>();
    else
      small ? launch.template operator()<1, true>() : launch.template operator()<1, false>();
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

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  cudaStream_t s = stream_of(out);
  dispatch_floating(out.dtype(), "swiglu", [&]<class T>() {
    Map2<T, T, SwigluMath<T>> f{static_cast<T*>(out.data_ptr()), static_cast<const T*>(gate.data_ptr()),
                                static_cast<const T*>(up.data_ptr()), {}};
    launch_elementwise<3>(out.shape(), {&out.strides(), &gate.strides(), &up.strides()}, f, s, "swiglu");
  });
}

void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& grad, const Tensor& gate, const Tensor& up) {
  cudaStream_t s = stream_of(grad);
  dispatch_floating(grad.dtype(), "swiglu_backward", [&]<class T>() {
    SwigluBackward<T> f{static_cast<T*>(dgate.data_ptr()), static_cast<T*>(dup.data_ptr()),
                        static_cast<const T*>(grad.data_ptr()), static_cast<const T*>(gate.data_ptr()),
                        static_cast<const T*>(up.data_ptr())};
    launch_elementwise<5>(grad.shape(), {&dgate.strides(), &dup.strides(), &grad.strides(), &gate.strides(), &up.strides()},
                          f, s, "swiglu_backward");
  });
}

}  // namespace kiln::kernels::cuda
