// CUDA bodies of the optimizer kernels (update math in kernels/optim.h, shared with the CPU):
// the multi-tensor AdamW and SGD updates (one launch per kMaxMultiSlots parameters, the slot list
// a kernel parameter; the per-parameter forms are a list of one), per-chunk partial
// norms for clip_grad_norm_ and their multi-tensor form (one block per chunk, each thread summing
// a fixed strided subset in double, then a fixed shared-memory tree), and the fused clip's
// reduction of the partials (one block, fixed order), so results are bitwise reproducible run
// to run.
// Launches on the device's stream, stream() of kernels/cuda/context.h (kiln::kernels::cuda).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kiln/core/dtype.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/optim.h"

namespace kiln::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// A block's values in sh[0..N) reduced by a fixed tree into sh[0] (sums, or maxima with NaN
// sticking for kNormInf); every thread calls it with its own value.
template <int N = kThreads>
__device__ void tree_reduce(double* sh, double acc, int mode) {
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int w = N / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) {
      const double x = sh[threadIdx.x], y = sh[threadIdx.x + w];
      sh[threadIdx.x] = mode == kNormInf ? ((x != x || y != y) ? x + y : (x > y ? x : y)) : x + y;
    }
    __syncthreads();
  }
}

// One chunk of a gradient's partial norm, computed by a whole block of kThreads threads: each
// thread sums a fixed strided subset of the chunk in double, then a fixed shared-memory tree.
// mode: kernels/optim.h's kNorm* (kNormInf: max |g|, NaN sticks). The result is in sh[0] on
// every thread after the call.
template <class T>
__device__ void norm_chunk_block(const T* __restrict__ g, int64_t n, int64_t chunk, double norm_type, int mode,
                                 double* sh) {
  const int64_t b = chunk * kNormChunk;
  const int64_t e = b + kNormChunk < n ? b + kNormChunk : n;
  double acc = 0;
  // A fixed trip count with predicated loads, so that a thread's loads are all in flight at
  // once (a loop to `e` issued them one after another: 0.9 TB/s on the H200, 4.4 ms of a 1b
  // step); each thread takes its elements in index order, zeros past the end changing no sum
  // and no max.
  static_assert(kNormChunk % kThreads == 0, "whole rounds of the block per chunk");
#pragma unroll
  for (int64_t j = 0; j < kNormChunk / kThreads; ++j) {
    const int64_t i = b + threadIdx.x + j * kThreads;
    const double a = i < e ? fabs(static_cast<double>(static_cast<acc_t<T>>(g[i]))) : 0.0;
    if (mode == kNormInf) acc = (a != a || a > acc) ? a : acc;
    else if (mode == kNormL2) acc += a * a;
    else if (mode == kNormL1) acc += a;
    else acc += pow(a, norm_type);
  }
  tree_reduce(sh, acc, mode);
}

template <class T>
__global__ void norm_partials_kernel(const T* __restrict__ g, int64_t n, double norm_type, int mode,
                                     double* __restrict__ out) {
  __shared__ double sh[kThreads];
  norm_chunk_block(g, n, static_cast<int64_t>(blockIdx.x), norm_type, mode, sh);
  if (threadIdx.x == 0) out[blockIdx.x] = sh[0];
}

// ---- multi-tensor (NOTE [multi-tensor step], kernels/optim.h) ----
// The slots of one launch, passed by value as a __grid_constant__ kernel parameter (read in
// place from the parameter space, never copied per thread). first[k]: the first block (update)
// or partial (norm) of slot k; first[count]: all of them. A block finds its slot by binary search.
// N: the capacity; the per-parameter forms launch a list of one (a parameter buffer of ~100
// bytes, not ~22 KiB, for each of their launches).
template <class Slot, int N = kMaxMultiSlots>
struct SlotList {
  int count = 0;
  int64_t first[N + 1];
  Slot slot[N];
};
static_assert(sizeof(SlotList<AdamWSlot>) + 2 * sizeof(void*) <= 32764, "CUDA 12.1's kernel parameter limit");

template <class Slot, int N>
__device__ int find_slot(const SlotList<Slot, N>& L, int64_t block) {
  int lo = 0, hi = L.count;  // L.first[lo] <= block < L.first[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (L.first[mid] <= block) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Elements per thread of a multi-tensor update; a block covers kThreads * kPerThread of a slot.
constexpr int kPerThread = 8;
constexpr int64_t kBlockElems = static_cast<int64_t>(kThreads) * kPerThread;

// The clip's scale (1 without one); false when the step is skipped (a non-finite norm).
__device__ inline bool clip_scale_of(const double* clip, float& scale) {
  scale = 1.0f;
  if (clip == nullptr) return true;
  const double norm = clip[0];
  if (!isfinite(norm)) return false;
  scale = static_cast<float>(clip[1]);
  return true;
}

template <class G>
__device__ void update_block(const AdamWSlot& sl, int64_t base, float scale) {
  const AdamWStep s = sl.s;
  const G* __restrict__ g = static_cast<const G*>(sl.g);
  float* __restrict__ p = sl.p;
  float* __restrict__ m = sl.m;
  float* __restrict__ v = sl.v;
  float pr[kPerThread], mr[kPerThread], vr[kPerThread], gr[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {  // all loads first: they are in flight together
    const int64_t i = base + threadIdx.x + j * kThreads;
    if (i < sl.n) {
      pr[j] = p[i];
      mr[j] = m[i];
      vr[j] = v[i];
      gr[j] = static_cast<float>(g[i]);
    }
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = base + threadIdx.x + j * kThreads;
    if (i < sl.n) {
      adamw_update(pr[j], mr[j], vr[j], scale == 1.0f ? gr[j] : gr[j] * scale, s);
      p[i] = pr[j];
      m[i] = mr[j];
      v[i] = vr[j];
    }
  }
}

template <class G>
__device__ void update_block(const SgdSlot& sl, int64_t base, float scale) {
  const SgdStep s = sl.s;
  const G* __restrict__ g = static_cast<const G*>(sl.g);
  float* __restrict__ p = sl.p;
  float* __restrict__ buf = sl.buf;
  float pr[kPerThread], br[kPerThread], gr[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = base + threadIdx.x + j * kThreads;
    if (i < sl.n) {
      pr[j] = p[i];
      br[j] = buf ? buf[i] : 0.0f;
      gr[j] = static_cast<float>(g[i]);
    }
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = base + threadIdx.x + j * kThreads;
    if (i < sl.n) {
      sgd_update(pr[j], buf ? &br[j] : nullptr, scale == 1.0f ? gr[j] : gr[j] * scale, s);
      p[i] = pr[j];
      if (buf) buf[i] = br[j];
    }
  }
}

// One block per kBlockElems of every slot's parameter: the update of the slot's kind (AdamW or SGD),
// its gradient scaled by the folded clip's scale (nothing when the norm was not finite).
template <class Slot, int N>
__global__ void update_multi_kernel(const __grid_constant__ SlotList<Slot, N> L, const double* __restrict__ clip) {
  float scale;
  if (!clip_scale_of(clip, scale)) return;
  const int k = find_slot(L, blockIdx.x);
  const Slot& sl = L.slot[k];
  const int64_t base = (static_cast<int64_t>(blockIdx.x) - L.first[k]) * kBlockElems;
  if (sl.grad_bf16) update_block<BFloat16>(sl, base, scale);
  else update_block<float>(sl, base, scale);
}

// One block per chunk of every slot; out: this launch's first partial.
__global__ void norm_partials_multi_kernel(const __grid_constant__ SlotList<NormSlot> L, double norm_type, int mode,
                                           double* __restrict__ out) {
  __shared__ double sh[kThreads];
  const int k = find_slot(L, blockIdx.x);
  const NormSlot& sl = L.slot[k];
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) - L.first[k];
  if (sl.grad_bf16) norm_chunk_block(static_cast<const BFloat16*>(sl.g), sl.n, chunk, norm_type, mode, sh);
  else norm_chunk_block(static_cast<const float*>(sl.g), sl.n, chunk, norm_type, mode, sh);
  if (threadIdx.x == 0) out[blockIdx.x] = sh[0];
}

// The clip from all partials: one block; thread t sums the contiguous run [n*t/T, n*(t+1)/T) in
// index order, then the fixed tree; thread 0 writes {norm, scale}.
constexpr int kFinalThreads = 1024;
__global__ void clip_from_partials_kernel(const double* __restrict__ v, int64_t n, double norm_type, int mode,
                                          double max_norm, double* __restrict__ clip) {
  __shared__ double sh[kFinalThreads];
  const int64_t b = n * threadIdx.x / kFinalThreads, e = n * (threadIdx.x + 1) / kFinalThreads;
  double acc = 0;
  for (int64_t i = b; i < e; ++i) acc = mode == kNormInf ? ((v[i] != v[i] || v[i] > acc) ? v[i] : acc) : acc + v[i];
  tree_reduce<kFinalThreads>(sh, acc, mode);
  if (threadIdx.x == 0) {
    const double norm = norm_from_sum(sh[0], mode, norm_type);
    clip[0] = norm;
    clip[1] = isfinite(norm) ? clip_scale(norm, max_norm) : 1.0;
  }
}

}  // namespace

void grad_norm_partials(const Tensor& grad, double norm_type, const Tensor& partials) {
  const int64_t n = grad.numel();
  const int64_t chunks = norm_partials_count(n);
  if (chunks == 0) return;
  const int mode = norm_mode(norm_type);
  cudaStream_t st = stream(grad.device().index);
  dispatch_floating(grad.dtype(), "clip_grad_norm_", [&]<class T>() {
    norm_partials_kernel<T><<<static_cast<unsigned>(chunks), kThreads, 0, st>>>(
        static_cast<const T*>(grad.data_ptr()), n, norm_type, mode, partials.data<double>());
    KILN_CUDA_CHECK_LAUNCH("clip_grad_norm_");
  });
}

namespace {

// Launches `launch(list, blocks, first_block)` once per kMaxMultiSlots slots; blocks_of(slot) is
// the slot's block count.
template <int N = kMaxMultiSlots, class Slot, class Blocks, class Launch>
void for_each_launch(const std::vector<Slot>& slots, Blocks&& blocks_of, Launch&& launch) {
  int64_t done = 0;  // blocks of the earlier launches
  for (size_t s0 = 0; s0 < slots.size(); s0 += N) {
    SlotList<Slot, N> L;
    const size_t s1 = std::min(slots.size(), s0 + N);
    L.count = static_cast<int>(s1 - s0);
    int64_t blocks = 0;
    for (size_t k = s0; k < s1; ++k) {
      L.first[k - s0] = blocks;
      L.slot[k - s0] = slots[k];
      blocks += blocks_of(slots[k]);
    }
    L.first[L.count] = blocks;
    KILN_CHECK(blocks < (int64_t{1} << 31), "optimizer: ", blocks, " blocks in one multi-tensor launch");
    if (blocks > 0) launch(L, static_cast<unsigned>(blocks), done);
    done += blocks;
  }
}

const double* clip_ptr(const Tensor& clip) { return clip.defined() ? clip.data<double>() : nullptr; }

bool grad_is_bf16(const Tensor& grad, const char* op) {
  KILN_CHECK(grad.dtype() == DType::f32 || grad.dtype() == DType::bf16, op, ": gradient dtype ",
             dtype_name(grad.dtype()), " is not supported (expected f32 or bf16)");
  return grad.dtype() == DType::bf16;
}

template <int N>
void launch_adamw(Device device, const std::vector<AdamWSlot>& slots, const Tensor& clip) {
  cudaStream_t st = stream(device.index);
  const double* c = clip_ptr(clip);
  for_each_launch<N>(
      slots, [](const AdamWSlot& s) { return (s.n + kBlockElems - 1) / kBlockElems; },
      [&](const SlotList<AdamWSlot, N>& L, unsigned blocks, int64_t) {
        update_multi_kernel<AdamWSlot, N><<<blocks, kThreads, 0, st>>>(L, c);
        KILN_CUDA_CHECK_LAUNCH("adamw_multi");
      });
}

template <int N>
void launch_sgd(Device device, const std::vector<SgdSlot>& slots, const Tensor& clip) {
  cudaStream_t st = stream(device.index);
  const double* c = clip_ptr(clip);
  for_each_launch<N>(
      slots, [](const SgdSlot& s) { return (s.n + kBlockElems - 1) / kBlockElems; },
      [&](const SlotList<SgdSlot, N>& L, unsigned blocks, int64_t) {
        update_multi_kernel<SgdSlot, N><<<blocks, kThreads, 0, st>>>(L, c);
        KILN_CUDA_CHECK_LAUNCH("sgd_multi");
      });
}

}  // namespace

void adamw_multi(Device device, const std::vector<AdamWSlot>& slots, const Tensor& clip) {
  launch_adamw<kMaxMultiSlots>(device, slots, clip);
}

void sgd_multi(Device device, const std::vector<SgdSlot>& slots, const Tensor& clip) {
  launch_sgd<kMaxMultiSlots>(device, slots, clip);
}

void grad_norm_partials_multi(Device device, const std::vector<NormSlot>& slots, double norm_type,
                              const Tensor& partials) {
  int64_t total = 0;
  for (const NormSlot& s : slots) total += norm_partials_count(s.n);
  KILN_CHECK(partials.numel() == total, "grad_norm_partials_multi: partials has ", partials.numel(),
             " elements, the slots need ", total);
  cudaStream_t st = stream(device.index);
  const int mode = norm_mode(norm_type);
  double* out = partials.data<double>();
  for_each_launch(
      slots, [](const NormSlot& s) { return norm_partials_count(s.n); },
      [&](const SlotList<NormSlot>& L, unsigned blocks, int64_t first) {
        norm_partials_multi_kernel<<<blocks, kThreads, 0, st>>>(L, norm_type, mode, out + first);
        KILN_CUDA_CHECK_LAUNCH("grad_norm_partials_multi");
      });
}

void clip_from_partials(const Tensor& partials, double norm_type, double max_norm, const Tensor& clip) {
  cudaStream_t st = stream(clip.device().index);
  const double* v = partials.numel() > 0 ? partials.data<double>() : nullptr;
  clip_from_partials_kernel<<<1, kFinalThreads, 0, st>>>(v, partials.numel(), norm_type, norm_mode(norm_type),
                                                         max_norm, clip.data<double>());
  KILN_CUDA_CHECK_LAUNCH("clip_from_partials");
}

// The per-parameter updates: the multi-tensor kernels over a list of one (so both paths run the
// same code and give the same bits).
void adamw(const AdamWStep& s, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
           const Tensor& exp_avg_sq) {
  if (param.numel() == 0) return;
  AdamWSlot sl;
  sl.p = param.data<float>();
  sl.m = exp_avg.data<float>();
  sl.v = exp_avg_sq.data<float>();
  sl.g = grad.data_ptr();
  sl.n = param.numel();
  sl.s = s;
  sl.grad_bf16 = grad_is_bf16(grad, "adamw");
  launch_adamw<1>(param.device(), {sl}, Tensor());
}

void sgd(const SgdStep& s, const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer) {
  if (param.numel() == 0) return;
  SgdSlot sl;
  sl.p = param.data<float>();
  sl.buf = momentum_buffer.defined() ? momentum_buffer.data<float>() : nullptr;
  sl.g = grad.data_ptr();
  sl.n = param.numel();
  sl.s = s;
  sl.grad_bf16 = grad_is_bf16(grad, "sgd");
  launch_sgd<1>(param.device(), {sl}, Tensor());
}

}  // namespace kiln::kernels::cuda
