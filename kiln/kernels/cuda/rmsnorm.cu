// RMSNorm kernels at memory speed (rmsnorm.h). A row of d elements is nvec = d / V vectors of
// V = 16 / itemsize elements; a block of `threads` threads holds it in registers, VPT vectors a
// thread (vector i of the row in thread i % threads, slot i / threads), so each thread has VPT
// independent 16-byte loads in flight per operand. VPT and threads come from nvec alone
// (row_config), so the reduction order — each thread's slots in order, a butterfly per warp (the
// same bits in every lane: each step adds the same two values), then the warps' sums in warp
// order — is fixed by the shape. f32 statistics for every dtype.
// Forward: a block per row. Backward: a persistent grid of G = (blocks per SM) × SMs blocks
// (fixed per machine and shape), block b taking rows b, b + G, ...; each block keeps its
// dweight partial for its columns in registers and writes it once ([G, d] f32); a second kernel
// sums the G partials per column in a fixed order (dweight_sum_kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/rmsnorm.h"

namespace kiln::kernels::cuda::rmsnorm {
namespace {

constexpr int64_t kMaxVectors = 2048;
constexpr int kFwdThreads = 512, kBwdThreads = 256;  // the blocks' caps (register budgets)

template <class T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_f(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

template <class T> constexpr int kV = static_cast<int>(16 / sizeof(T));

// VPT vectors of a row in registers, as f32.
template <class T, int VPT>
struct RowRegs {
  float v[VPT][kV<T>];
};

// Vector i of a row (f32), zeros past nvec.
template <class T>
__device__ __forceinline__ void load_vec(float (&v)[kV<T>], const T* __restrict__ row, int i, int nvec) {
  if (i < nvec) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row) + i);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kV<T>; ++k) v[k] = to_f(e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kV<T>; ++k) v[k] = 0.f;
  }
}

template <class T, int VPT>
__device__ __forceinline__ void load_row(RowRegs<T, VPT>& r, const T* __restrict__ row, int nvec) {
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < nvec) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row) + i);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kV<T>; ++k) r.v[j][k] = to_f(e[k]);
    } else {
#pragma unroll
      for (int k = 0; k < kV<T>; ++k) r.v[j][k] = 0.f;
    }
  }
}
template <class T, int VPT>
__device__ __forceinline__ void store_row(T* __restrict__ row, const RowRegs<T, VPT>& r, int nvec) {
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < nvec) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < kV<T>; ++k) e[k] = from_f<T>(r.v[j][k]);
      reinterpret_cast<uint4*>(row)[i] = raw;
    }
  }
}

// The block's sum of v in a fixed order; every thread gets it. `sh` holds 32 floats; the caller
// syncs before reusing it.
__device__ __forceinline__ float block_sum(float v, float* sh) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) sh[warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < nw; ++w) s += sh[w];
  return s;
}

// kAdd: h = x + res first (stored), normalised as rounded to T.
template <class T, int VPT, bool kAdd>
__global__ void __launch_bounds__(kFwdThreads) rmsnorm_fwd_kernel(T* __restrict__ y, float* __restrict__ rstd, T* __restrict__ h,
                                   const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w, int nvec,
                                   int d, float eps) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  RowRegs<T, VPT> xr;
  load_row<T, VPT>(xr, x + r * d, nvec);
  if constexpr (kAdd) {
    RowRegs<T, VPT> rr;
    load_row<T, VPT>(rr, res + r * d, nvec);
#pragma unroll
    for (int j = 0; j < VPT; ++j)
#pragma unroll
      for (int k = 0; k < kV<T>; ++k) xr.v[j][k] = to_f(from_f<T>(xr.v[j][k] + rr.v[j][k]));
    store_row<T, VPT>(h + r * d, xr, nvec);
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j)
#pragma unroll
    for (int k = 0; k < kV<T>; ++k) ss += xr.v[j][k] * xr.v[j][k];
  ss = block_sum(ss, sh);
  const float rs = 1.f / sqrtf(ss / static_cast<float>(d) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    float wv[kV<T>];
    load_vec<T>(wv, w, threadIdx.x + j * blockDim.x, nvec);
#pragma unroll
    for (int k = 0; k < kV<T>; ++k) xr.v[j][k] = xr.v[j][k] * rs * wv[k];
  }
  store_row<T, VPT>(y + r * d, xr, nvec);
}

template <class T, int VPT>
__global__ void __launch_bounds__(kBwdThreads) rmsnorm_bwd_kernel(T* __restrict__ dx, float* __restrict__ partial, const T* __restrict__ dy,
                                   const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ rstd,
                                   const T* __restrict__ extra, int64_t rows, int nvec, int d) {
  __shared__ float sh[32];
  RowRegs<T, VPT> acc;  // this block's dweight partial of its columns
#pragma unroll
  for (int j = 0; j < VPT; ++j)
#pragma unroll
    for (int k = 0; k < kV<T>; ++k) acc.v[j][k] = 0.f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    RowRegs<T, VPT> xr, gr;
    load_row<T, VPT>(xr, x + r * d, nvec);
    load_row<T, VPT>(gr, dy + r * d, nvec);
    const float rs = rstd[r];
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      float wv[kV<T>];  // w from L1 / L2 (read by every row)
      load_vec<T>(wv, w, threadIdx.x + j * blockDim.x, nvec);
#pragma unroll
      for (int k = 0; k < kV<T>; ++k) {
        dot += gr.v[j][k] * wv[k] * xr.v[j][k];
        acc.v[j][k] += gr.v[j][k] * xr.v[j][k] * rs;
      }
    }
    dot = block_sum(dot, sh);
    const float kk = dot * rs * rs * rs / static_cast<float>(d);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      float wv[kV<T>];
      load_vec<T>(wv, w, threadIdx.x + j * blockDim.x, nvec);
#pragma unroll
      for (int k = 0; k < kV<T>; ++k) gr.v[j][k] = gr.v[j][k] * wv[k] * rs - xr.v[j][k] * kk;
    }
    if (extra) {
      RowRegs<T, VPT> er;
      load_row<T, VPT>(er, extra + r * d, nvec);
#pragma unroll
      for (int j = 0; j < VPT; ++j)
#pragma unroll
        for (int k = 0; k < kV<T>; ++k) gr.v[j][k] += er.v[j][k];
    }
    store_row<T, VPT>(dx + r * d, gr, nvec);
    __syncthreads();  // sh is written again by the next row's block_sum
  }
  if (!partial) return;
  float* p = partial + static_cast<int64_t>(blockIdx.x) * d;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < nvec) {
#pragma unroll
      for (int k = 0; k < kV<T>; k += 4)
        *reinterpret_cast<float4*>(p + i * kV<T> + k) =
            make_float4(acc.v[j][k], acc.v[j][k + 1], acc.v[j][k + 2], acc.v[j][k + 3]);
    }
  }
}

// dweight[c] = Σ_b partial[b, c] in a fixed order: a block of kSumWarps warps takes 32 columns
// (a warp's loads are one 128-byte row segment), warp w sums the partials b ≡ w (mod kSumWarps)
// in order, then the warps' sums are added in warp order. (It was a thread per column over every
// partial in turn: d threads in d / 256 blocks, far fewer than the SMs, each walking G partials.)
constexpr int kSumWarps = 8;
template <class W>
__global__ void __launch_bounds__(32 * kSumWarps) dweight_sum_kernel(W* __restrict__ dw, const float* __restrict__ partial,
                                                                      int64_t blocks, int64_t d) {
  __shared__ float sh[kSumWarps][32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t c = blockIdx.x * int64_t{32} + lane;
  float s = 0.f;
  if (c < d) {
#pragma unroll 4
    for (int64_t b = w; b < blocks; b += kSumWarps) s += partial[b * d + c];
  }
  sh[w][lane] = s;
  __syncthreads();
  if (w == 0 && c < d) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < kSumWarps; ++k) t += sh[k][lane];
    dw[c] = from_f<W>(t);
  }
}

struct RowConfig {
  int vpt, threads;
};
// The vectors a thread holds: 1 for short rows, else at least 2 (loads in flight), more where the
// row would need more than max_threads threads.
RowConfig row_config(int64_t nvec, int max_threads) {
  int vpt = nvec <= 64 ? 1 : 2;
  while (vpt < 8 && (nvec + vpt - 1) / vpt > max_threads) vpt *= 2;
  const int64_t t = (nvec + vpt - 1) / vpt;
  return {vpt, static_cast<int>(std::max<int64_t>(32, (t + 31) / 32 * 32))};
}

template <class F>
void with_vpt(int vpt, F&& f) {
  switch (vpt) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 4: f.template operator()<4>(); break;
    default: f.template operator()<8>(); break;
  }
}

template <class F>
bool with_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: f.template operator()<float>(); return true;
    case DType::bf16: f.template operator()<__nv_bfloat16>(); return true;
    case DType::f16: f.template operator()<__half>(); return true;
    default: return false;
  }
}

bool aligned(const Tensor& t) {
  return !t.defined() || (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0);
}

}  // namespace

bool applies(DType t, int64_t d) {
  if (t != DType::f32 && t != DType::bf16 && t != DType::f16) return false;
  const int64_t es = static_cast<int64_t>(itemsize(t));
  return d > 0 && (d * es) % 16 == 0 && d * es / 16 <= kMaxVectors;
}

namespace {
// Launches the forward (kAdd: with the residual add, h and res defined) on rows of x.
template <bool kAdd>
void launch_forward(const Tensor& out, const Tensor& rstd, const Tensor& h, const Tensor& x, const Tensor& res,
                    const Tensor& weight, double eps, int64_t rows, int64_t d) {
  const int64_t nvec = d * static_cast<int64_t>(itemsize(x.dtype())) / 16;
  const RowConfig rc = row_config(nvec, kFwdThreads);
  const cudaStream_t s = stream(x.device().index);
  with_dtype(x.dtype(), [&]<class T>() {
    with_vpt(rc.vpt, [&]<int VPT>() {
      rmsnorm_fwd_kernel<T, VPT, kAdd><<<static_cast<unsigned>(rows), rc.threads, 0, s>>>(
          static_cast<T*>(out.data_ptr()), rstd.data<float>(), kAdd ? static_cast<T*>(h.data_ptr()) : nullptr,
          static_cast<const T*>(x.data_ptr()), kAdd ? static_cast<const T*>(res.data_ptr()) : nullptr,
          static_cast<const T*>(weight.data_ptr()), static_cast<int>(nvec), static_cast<int>(d), static_cast<float>(eps));
    });
  });
  KILN_CUDA_CHECK_LAUNCH(kAdd ? "rms_norm_add forward" : "rms_norm forward");
}
}  // namespace

bool forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight, double eps) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  if (!applies(x.dtype(), d) || weight.dtype() != x.dtype() || rstd.dtype() != DType::f32 ||
      !aligned(out) || !aligned(x) || !aligned(weight) || rows >= (int64_t{1} << 31))
    return false;
  if (rows == 0) return true;
  launch_forward<false>(out, rstd, Tensor(), x, Tensor(), weight, eps, rows, d);
  return true;
}

void add_forward(const Tensor& h, const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& residual,
                 const Tensor& weight, double eps) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  KILN_CHECK(x.is_cuda() && residual.shape() == x.shape() && h.shape() == x.shape() && out.shape() == x.shape() &&
                 weight.dim() == 1 && weight.size(0) == d && rstd.numel() == rows,
             "rms_norm_add: x, residual, h and out of one shape [rows, d] on CUDA, weight [d], rstd [rows]");
  KILN_CHECK(residual.dtype() == x.dtype() && h.dtype() == x.dtype() && out.dtype() == x.dtype() &&
                 weight.dtype() == x.dtype() && rstd.dtype() == DType::f32,
             "rms_norm_add: x, residual, h, out and weight of one dtype, rstd f32");
  KILN_CHECK(applies(x.dtype(), d), "rms_norm_add: rows of ", d, " ", dtype_name(x.dtype()),
             " elements are not a whole number of 16-byte vectors (or longer than ", kMaxVectors, " vectors)");
  KILN_CHECK(aligned(h) && aligned(out) && aligned(x) && aligned(residual) && aligned(weight) && rstd.is_contiguous(),
             "rms_norm_add: contiguous tensors with 16-byte aligned data");
  if (rows == 0) return;
  launch_forward<true>(out, rstd, h, x, residual, weight, eps, rows, d);
}

bool backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x, const Tensor& weight,
              const Tensor& rstd, const Tensor& dh_extra) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  if (!applies(x.dtype(), d) || weight.dtype() != x.dtype() || rstd.dtype() != DType::f32 || !aligned(dx) ||
      !aligned(dy) || !aligned(x) || !aligned(weight) || !aligned(dh_extra) || !rstd.is_contiguous() ||
      (dweight.defined() && (dweight.dtype() != x.dtype() || !dweight.is_contiguous())) ||
      (dh_extra.defined() && dh_extra.dtype() != x.dtype()))
    return false;
  if (rows == 0) {
    if (dweight.defined()) KILN_CUDA_CHECK(cudaMemsetAsync(dweight.data_ptr(), 0, dweight.nbytes(), stream(x.device().index)));
    return true;
  }
  const int dev = x.device().index;
  const DeviceContext& ctx = context(dev);
  const cudaStream_t s = stream(dev);
  const int64_t nvec = d * static_cast<int64_t>(itemsize(x.dtype())) / 16;
  const RowConfig rc = row_config(nvec, kBwdThreads);
  with_dtype(x.dtype(), [&]<class T>() {
    with_vpt(rc.vpt, [&]<int VPT>() {
      auto kernel = rmsnorm_bwd_kernel<T, VPT>;
      int per_sm = 0;
      KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, rc.threads, 0));
      const int64_t blocks = std::min<int64_t>(rows, int64_t{std::max(per_sm, 1)} * std::max(ctx.sm_count, 1));
      Tensor partial;
      if (dweight.defined()) partial = Tensor::empty({blocks, d}, DType::f32, x.device());
      kernel<<<static_cast<unsigned>(blocks), rc.threads, 0, s>>>(
          static_cast<T*>(dx.data_ptr()), partial.defined() ? partial.data<float>() : nullptr,
          static_cast<const T*>(dy.data_ptr()), static_cast<const T*>(x.data_ptr()),
          static_cast<const T*>(weight.data_ptr()), rstd.data<float>(),
          dh_extra.defined() ? static_cast<const T*>(dh_extra.data_ptr()) : nullptr, rows, static_cast<int>(nvec),
          static_cast<int>(d));
      KILN_CUDA_CHECK_LAUNCH("rms_norm backward");
      if (!dweight.defined()) return;
      dweight_sum_kernel<T><<<static_cast<unsigned>((d + 31) / 32), 32 * kSumWarps, 0, s>>>(
          static_cast<T*>(dweight.data_ptr()), partial.data<float>(), blocks, d);
      KILN_CUDA_CHECK_LAUNCH("rms_norm backward (dweight)");
    });
  });
  return true;
}

}  // namespace kiln::kernels::cuda::rmsnorm
