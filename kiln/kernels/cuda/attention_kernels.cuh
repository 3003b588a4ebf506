// The CUDA FlexAttention bodies as templates over (score_mod, mask_mod): flex_forward /
// flex_backward pick the first kernels that apply: the Hopper ones (attention_fwd_wgmma.cuh,
// attention_bwd_wgmma.cuh), the mma.sync ones (attention_fwd_mma.cuh, attention_bwd_mma.cuh),
// then the SIMT kernels (attention_simt.cuh); classify_tiles builds BlockMasks
// on the GPU. A .cu file that includes this header and writes KILN_FLEX_CUDA_INSTANTIATE(SM, MM)
// gets the kernels for its own mods (the library's: attention_masks_*.cu and attention_mods_*.cu,
// one or two combinations a file so that a parallel build compiles them side by side); they
// register in the KernelRegistry, where the front end finds them.
//
// The SIMT kernels: one thread owns one query row (forward, dQ) or one kv row (dK/dV), iterating
// the BlockMask's tile lists (partial tiles evaluate the mask_mod, full tiles skip it, empty
// tiles are never visited), f32 math on f32/bf16/f16 storage, any length, GQA, fully masked
// rows → 0 / −inf. The backward is bitwise deterministic: each dQ row and each dK/dV row has one
// owner thread that reduces in a fixed order (no atomics); a learnable score_mod's table
// gradient is summed per (b, h, q block) by one thread each, then over b and q blocks in order
// (the CPU kernel's order). They stay the oracle of the tensor-core kernels, and the CUDA path of
// head dims the tensor-core kernels do not take (any E, Ev ≤ kMaxDim = 256: Gemma's 256 among them).
// A thread's row vectors (q, dO, the accumulators) sit in local memory, sized MAXD: 128 where
// both head dims fit, else 256, because the driver reserves a thread's frame for every thread
// the GPU can hold (4 KB × ~270k threads on an H200 for dK/dV at 256, half that at 128).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kiln/kernels/flex_tiles.h"
#include "kiln/kernels/flex_mods.h"
#include "kiln/core/error.h"
#include "kiln/core/half.h"
#include "kiln/core/kernel_registry.h"
#include "kiln/kernels/attention.h"
#include "kiln/kernels/flex_files.h"
#include "kiln/kernels/cuda/attention_fwd_mma.cuh"
#include "kiln/kernels/cuda/attention_launch.cuh"
#include "kiln/kernels/cuda/attention_simt.cuh"
#include "kiln/kernels/cuda/context.h"

namespace kiln::kernels::cuda {
namespace {

// The SIMT kernels (attention_simt.cuh, device-only).
using namespace flex_simt;

// The current stream of the current device (NOTE [current stream], core/stream.h).
cudaStream_t flex_stream() { return stream(flex_mma::current_context().device); }

void check_dims(const FlexParams& p) {
  KILN_CHECK(p.E <= kMaxDim && p.Ev <= kMaxDim, "flex_attention (CUDA): head dims up to ", kMaxDim, ", got E=", p.E,
             ", Ev=", p.Ev, " (the tensor-core kernels take 64 and 128, the SIMT ones up to ", kMaxDim, ")");
  KILN_CHECK(p.nQ < 65536 * 32 && p.Hq < 65536 && p.B < 65536, "flex_attention (CUDA): grid too large");
}

// f.operator()<MAXD>() with the SIMT kernels' vector size for the call's head dims (check_dims).
template <class F>
void dispatch_max_dim(const FlexParams& p, F&& f) {
  if (p.E <= 128 && p.Ev <= 128) return f.template operator()<128>();
  return f.template operator()<kMaxDim>();
}

template <class F>
void dispatch_dt(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: return f.template operator()<float>();
    case DType::bf16: return f.template operator()<BFloat16>();
    case DType::f16: return f.template operator()<Half>();
    default: fail("flex_attention (CUDA): dtype ", dtype_name(dt), " is not supported");
  }
}

constexpr const char* kHopperNeeds =
    "hopper: bf16 or f16, E = Ev in {64, 128}, BlockMask blocks that are multiples of 128, 16-byte-aligned rows, "
    "strides a TMA tensor map can describe (none zero, as an expand() gives), the device's full shared memory per "
    "block (about 225 KB), and in the backward no learnable score_mod and B*Hq*L < 2^31";
constexpr const char* kSm80Needs =
    "sm80: bf16 or f16, E = Ev in {64, 128, 256}, BlockMask blocks that are multiples of 64, "
    "16-byte-aligned rows, and in the backward no learnable score_mod";

// Runs the first tensor-core kernels that FlexOptions::backend allows and that apply: `hopper`
// (TMA + wgmma), then `sm80` (mma.sync), each returning false where it does not apply. False:
// the SIMT kernels are to run. A required family that does not apply fails with what it needs.
template <class Hopper, class Sm80>
bool run_tensor_core_kernels(const FlexParams& p, Hopper&& hopper, Sm80&& sm80) {
  auto attempt = [&](FlexBackend family, auto&& run, const char* needs) {
    if (p.backend != FlexBackend::automatic && p.backend != family) return false;
    if (run()) return true;
    if (p.backend != FlexBackend::automatic)
      fail("flex_attention (CUDA): the backend required by FlexOptions::backend or KILN_FLEX_KERNEL does not apply "
           "to this call: it needs ", needs, " (backend auto picks the fastest kernels that apply)");
    return false;
  };
  return attempt(FlexBackend::hopper, hopper, kHopperNeeds) || attempt(FlexBackend::sm80, sm80, kSm80Needs);
}

}  // namespace

template <class SM, class MM>
void flex_forward(const FlexParams& p, DType dt, const SM& sm, const MM& mm) {
  check_dims(p);
  cudaStream_t st = flex_stream();
  dispatch_dt(dt, [&]<class T>() {
    if (run_tensor_core_kernels(p, [&] { return flex_wgmma::flex_forward_wgmma<T>(p, sm, mm, st); },
                                [&] { return flex_mma::flex_forward_mma<T>(p, sm, mm, st); }))
      return;
    dim3 grid(static_cast<unsigned>(p.nQ), static_cast<unsigned>(p.Hq), static_cast<unsigned>(p.B));
    dispatch_max_dim(p, [&]<int MAXD>() { flex_fwd_kernel<MAXD, T><<<grid, kThreads, 0, st>>>(p, sm, mm); });
    KILN_CUDA_CHECK_LAUNCH("flex_fwd_kernel");
  });
}

template <class SM, class MM>
void flex_backward(const FlexParams& p, DType dt, const SM& sm, const MM& mm) {
  check_dims(p);
  cudaStream_t st = flex_stream();
  dispatch_dt(dt, [&]<class T>() {
    if (run_tensor_core_kernels(p, [&] { return flex_wgmma::flex_backward_wgmma<T>(p, sm, mm, st); },
                                [&] { return flex_mma::flex_backward_mma<T>(p, sm, mm, st); }))
      return;
    const int64_t rows = p.B * p.Hq * p.L;
    flex_delta_kernel<T><<<static_cast<unsigned>((rows + 255) / 256), 256, 0, st>>>(p);
    KILN_CUDA_CHECK_LAUNCH("flex_delta_kernel");
    dim3 gq(static_cast<unsigned>(p.nQ), static_cast<unsigned>(p.Hq), static_cast<unsigned>(p.B));
    dim3 gk(static_cast<unsigned>(p.nKV), static_cast<unsigned>(p.Hkv), static_cast<unsigned>(p.B));
    dispatch_max_dim(p, [&]<int MAXD>() {
      flex_dq_kernel<MAXD, T><<<gq, kThreads, 0, st>>>(p, sm, mm);
      KILN_CUDA_CHECK_LAUNCH("flex_dq_kernel");
      flex_dkdv_kernel<MAXD, T><<<gk, kThreads, 0, st>>>(p, sm, mm);
      KILN_CUDA_CHECK_LAUNCH("flex_dkdv_kernel");
    });
    if constexpr (attention::is_learnable_v<SM>) {
      if (p.dbias != nullptr) {
        const int64_t owners = p.B * p.Hq * p.nQ, cells = p.Hq * p.bias_row;
        flex_dbias_partial_kernel<T><<<static_cast<unsigned>((owners + 127) / 128), 128, 0, st>>>(p, sm, mm);
        KILN_CUDA_CHECK_LAUNCH("flex_dbias_partial_kernel");
        flex_dbias_reduce_kernel<><<<static_cast<unsigned>((cells + 255) / 256), 256, 0, st>>>(p);
        KILN_CUDA_CHECK_LAUNCH("flex_dbias_reduce_kernel");
      }
    }
  });
}

template <class MM>
void classify_tiles(const MM& mm, int64_t Bm, int64_t Hm, int64_t L, int64_t S, int64_t qb, int64_t kb,
                    uint8_t* classes) {
  const int64_t n = Bm * Hm * ((L + qb - 1) / qb) * ((S + kb - 1) / kb);
  if (n == 0) return;
  classify_tiles_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, flex_stream()>>>(mm, Bm, Hm, L, S, qb, kb,
                                                                                           classes);
  KILN_CUDA_CHECK_LAUNCH("classify_tiles_kernel");
}

// classify_tiles with the mask passed by address (kernels::FlexClassifyEntry).
template <class MM>
void classify_tiles_erased(const void* mm, int64_t Bm, int64_t Hm, int64_t L, int64_t S, int64_t qb, int64_t kb,
                           uint8_t* classes) {
  classify_tiles<MM>(*static_cast<const MM*>(mm), Bm, Hm, L, S, qb, kb, classes);
}

// The explicit instantiations of one (score_mod, mask_mod) pair, registered in the KernelRegistry
// (kernels/attention.h: flex_key, FlexEntry) when the program starts.
#define KILN_FLEX_CUDA_CAT2(a, b) a##b
#define KILN_FLEX_CUDA_CAT(a, b) KILN_FLEX_CUDA_CAT2(a, b)
#define KILN_FLEX_CUDA_INSTANTIATE(SM, MM)                                                                    \
  template void flex_forward<SM, MM>(const FlexParams&, DType, const SM&, const MM&);                         \
  template void flex_backward<SM, MM>(const FlexParams&, DType, const SM&, const MM&);                        \
  static const ::kiln::KernelRegistrar KILN_FLEX_CUDA_CAT(flex_registrar_, __COUNTER__){                      \
      ::kiln::kernels::flex_key<SM, MM>("flex_forward", "cuda"),                                             \
      reinterpret_cast<const void*>(&::kiln::kernels::flex_erased<SM, MM, true>), "built in (" __FILE__ ")"}; \
  static const ::kiln::KernelRegistrar KILN_FLEX_CUDA_CAT(flex_registrar_, __COUNTER__){                      \
      ::kiln::kernels::flex_key<SM, MM>("flex_backward", "cuda"),                                            \
      reinterpret_cast<const void*>(&::kiln::kernels::flex_erased<SM, MM, false>), "built in (" __FILE__ ")"};
// Each instantiation file names itself once: nothing else refers to a file whose kernels only
// register themselves, so a static link would leave it out; flex_builtin_files
// (kernels/cuda/flex_files.cpp, which the front end refers to) names every such symbol.
#define KILN_FLEX_CUDA_FILE(name) \
  extern "C" void kiln_flex_cuda_file_##name() {}
// A library mask: its kernels without a score_mod and its GPU BlockMask builder (create_block_mask
// from a MaskSpec on a CUDA device), registered under kFlexClassifyFamily (kernels/flex_files.h).
#define KILN_FLEX_CUDA_INSTANTIATE_MASK(MM)                                                                    \
  KILN_FLEX_CUDA_INSTANTIATE(::kiln::attention::NoScoreMod, MM)                                               \
  template void classify_tiles<MM>(const MM&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint8_t*);  \
  static const ::kiln::KernelRegistrar KILN_FLEX_CUDA_CAT(flex_registrar_, __COUNTER__){                       \
      ::kiln::kernels::flex_key<::kiln::attention::NoScoreMod, MM>(::kiln::kernels::kFlexClassifyFamily, "cuda"), \
      reinterpret_cast<const void*>(&::kiln::kernels::cuda::classify_tiles_erased<MM>), "built in (" __FILE__ ")"};

}  // namespace kiln::kernels::cuda
