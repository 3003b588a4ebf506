// Host helpers of the tensor-core FlexAttention launchers (attention_fwd_mma.cuh, and
// attention_launch.cuh for the mma.sync backward and the Hopper kernels): the kiln → CUDA 16-bit
// type map, the current device's context, the shared-memory opt-in, and the checks of whether a
// layout suits the kernels. The kernels themselves are in device-only headers
// (attention_mma_common.cuh and the headers that build on it).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kiln/core/half.h"
#include "kiln/kernels/flex_params.h"
#include "kiln/kernels/cuda/context.h"

namespace kiln::kernels::cuda::flex_mma {

// kiln's storage types → the CUDA types of the mma (same bits); void for unsupported ones.
template <class T> struct CudaType { using type = void; };
template <> struct CudaType<BFloat16> { using type = __nv_bfloat16; };
template <> struct CudaType<Half> { using type = __half; };
template <> struct CudaType<__nv_bfloat16> { using type = __nv_bfloat16; };
template <> struct CudaType<__half> { using type = __half; };
template <class T> using cuda_t = typename CudaType<T>::type;

// Host: the context of the current device (its SM count and shared-memory limit).
inline DeviceContext& current_context() {
  int d = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&d));
  return context(d);
}

// Host: lets `kernel` use `bytes` of dynamic shared memory (beyond the default 48 KB).
template <class K> void set_smem(K kernel, int bytes) {
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// Host: whether the tensor-core kernels can run this layout with CTA tiles of q_tile query rows
// and kv_tile keys: E == Ev ∈ {64, 128} (or 256 with head_dim_256: the mma.sync forward); every
// q/k/v row 16-byte aligned (pointers and all strides multiples of 8 elements); the BlockMask's
// blocks multiples of the tiles (a tile then never straddles two blocks); lengths and grid dims
// in range.
inline bool mma_layout_ok(const FlexParams& p, int64_t q_tile, int64_t kv_tile, bool head_dim_256 = false) {
  if (p.E != p.Ev || (p.E != 64 && p.E != 128 && !(head_dim_256 && p.E == 256))) return false;
  auto aligned = [](const void* ptr, const int64_t (&st)[3]) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && st[0] % 8 == 0 && st[1] % 8 == 0 && st[2] % 8 == 0;
  };
  if (!aligned(p.q, p.q_st) || !aligned(p.k, p.k_st) || !aligned(p.v, p.v_st)) return false;
  if (p.QB % q_tile != 0 || p.KB % kv_tile != 0) return false;
  if (p.Hkv <= 0 || p.Hq % p.Hkv != 0) return false;
  return p.L < (int64_t{1} << 31) && p.S < (int64_t{1} << 31) && p.QB < (int64_t{1} << 31) && p.Hq < 65536 && p.B < 65536 &&
         (p.L + q_tile - 1) / q_tile < (int64_t{1} << 31);
}

namespace bwd {
inline bool aligned16(const void* x) { return (reinterpret_cast<uintptr_t>(x) & 15) == 0; }
}  // namespace bwd

}  // namespace kiln::kernels::cuda::flex_mma
