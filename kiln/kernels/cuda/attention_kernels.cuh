// The CUDA FlexAttention bodies as templates over (score_mod, mask_mod): flex_forward /
// flex_backward pick the first kernels that apply: the Hopper ones (attention_fwd_wgmma.cuh,
// attention_bwd_wgmma.cuh), the mma.sync ones (attention_fwd_mma.cuh, attention_bwd_mma.cuh),
// then the SIMT kernels here; classify_tiles builds BlockMasks
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
#include "kiln/kernels/cuda/attention_bwd_mma.cuh"
#include "kiln/kernels/cuda/attention_fwd_mma.cuh"
#include "kiln/kernels/cuda/attention_bwd_wgmma.cuh"
#include "kiln/kernels/cuda/attention_fwd_wgmma.cuh"
#include "kiln/kernels/cuda/context.h"

namespace kiln::kernels::cuda {
namespace {

constexpr int kMaxDim = 256;  // the SIMT kernels' largest head dim (E and Ev)
constexpr int kThreads = 128;

struct Lists {
  const int32_t* num;
  const int32_t* idx;
};

__device__ __forceinline__ int64_t mask_row(const FlexParams& p, int64_t b, int64_t h) {
  return (p.Bm == 1 ? 0 : b) * p.Hm + (p.Hm == 1 ? 0 : h);
}

template <int MAXD, class T, class SM, class MM>
__global__ void flex_fwd_kernel(FlexParams p, SM sm, MM mm) {
  const int64_t qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (p.Hq / p.Hkv);
  const int64_t row = mask_row(p, b, h) * p.nQ + qb;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k) + b * p.k_st[0] + hk * p.k_st[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_st[0] + hk * p.v_st[1];
  for (int64_t i = qb * p.QB + threadIdx.x; i < min((qb + 1) * p.QB, p.L); i += blockDim.x) {
    float qr[MAXD], acc[MAXD];
    const T* qi = q + b * p.q_st[0] + h * p.q_st[1] + i * p.q_st[2];
    for (int e = 0; e < p.E; ++e) qr[e] = static_cast<float>(qi[e]);
    for (int e = 0; e < p.Ev; ++e) acc[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int pass = 0; pass < 2; ++pass) {
      const bool partial = pass == 0;
      const auto [cnt, idx] = p.kv_blocks(row, partial);
      for (int32_t c = 0; c < cnt; ++c) {
        const int64_t j0 = static_cast<int64_t>(idx[c]) * p.KB, j1 = min(j0 + p.KB, p.S);
        for (int64_t j = j0; j < j1; ++j) {
          if (partial && !mm(int(b), int(h), int(i), int(j))) continue;
          const T* kj = k + j * p.k_st[2];
          float s = 0.0f;
          for (int e = 0; e < p.E; ++e) s += qr[e] * static_cast<float>(kj[e]);
          const float x = sm(s * p.scale, int(b), int(h), int(i), int(j));
          if (x == -INFINITY) continue;
          const float mn = fmaxf(m, x);
          const float alpha = __expf(m - mn), pj = __expf(x - mn);
          l = l * alpha + pj;
          const T* vj = v + j * p.v_st[2];
          for (int e = 0; e < p.Ev; ++e) acc[e] = acc[e] * alpha + pj * static_cast<float>(vj[e]);
          m = mn;
        }
      }
    }
    const int64_t o = (b * p.Hq + h) * p.L + i;
    T* out = static_cast<T*>(p.out) + o * p.Ev;
    const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // 0: nothing kept; NaN (a NaN score) stays NaN
    for (int e = 0; e < p.Ev; ++e) out[e] = static_cast<T>(acc[e] * inv);
    p.lse[o] = l != 0.0f ? m + logf(l) : -INFINITY;
  }
}

template <class T>
__global__ void flex_delta_kernel(FlexParams p) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= p.B * p.Hq * p.L) return;
  const T* o = static_cast<const T*>(p.out) + r * p.Ev;
  const T* g = static_cast<const T*>(p.dout) + r * p.Ev;
  float d = 0.0f;
  for (int e = 0; e < p.Ev; ++e) d += static_cast<float>(o[e]) * static_cast<float>(g[e]);
  p.delta[r] = d - (p.dlse ? p.dlse[r] : 0.0f);
}

// dS of one (i, j) pair (already times score_mod' and scale), and P; false when masked.
template <class SM>
__device__ __forceinline__ bool pair_grad(const FlexParams& p, const SM& sm, float dot_qk, float dot_dov, float lse,
                                          float delta, int b, int h, int i, int j, float& pj, float& ds) {
  if (lse == -INFINITY) return false;
  const float raw = dot_qk * p.scale;
  const float x = sm(raw, b, h, i, j);
  if (x == -INFINITY) return false;
  pj = __expf(x - lse);
  ds = pj * (dot_dov - delta) * sm.dscore(raw, b, h, i, j) * p.scale;
  return true;
}

template <int MAXD, class T, class SM, class MM>
__global__ void flex_dq_kernel(FlexParams p, SM sm, MM mm) {
  const int64_t qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (p.Hq / p.Hkv);
  const int64_t row = mask_row(p, b, h) * p.nQ + qb;
  const T* k = static_cast<const T*>(p.k) + b * p.k_st[0] + hk * p.k_st[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_st[0] + hk * p.v_st[1];
  for (int64_t i = qb * p.QB + threadIdx.x; i < min((qb + 1) * p.QB, p.L); i += blockDim.x) {
    float qr[MAXD], gr[MAXD], dq[MAXD];
    const T* qi = static_cast<const T*>(p.q) + b * p.q_st[0] + h * p.q_st[1] + i * p.q_st[2];
    const int64_t o = (b * p.Hq + h) * p.L + i;
    const T* gi = static_cast<const T*>(p.dout) + o * p.Ev;
    for (int e = 0; e < p.E; ++e) qr[e] = static_cast<float>(qi[e]), dq[e] = 0.0f;
    for (int e = 0; e < p.Ev; ++e) gr[e] = static_cast<float>(gi[e]);
    const float lse = p.lse[o], delta = p.delta[o];
    for (int pass = 0; pass < 2; ++pass) {
      const bool partial = pass == 0;
      const auto [cnt, idx] = p.kv_blocks(row, partial);
      for (int32_t c = 0; c < cnt; ++c) {
        const int64_t j0 = static_cast<int64_t>(idx[c]) * p.KB, j1 = min(j0 + p.KB, p.S);
        for (int64_t j = j0; j < j1; ++j) {
          if (partial && !mm(int(b), int(h), int(i), int(j))) continue;
          const T* kj = k + j * p.k_st[2];
          const T* vj = v + j * p.v_st[2];
          float s = 0.0f, dp = 0.0f;
          for (int e = 0; e < p.E; ++e) s += qr[e] * static_cast<float>(kj[e]);
          for (int e = 0; e < p.Ev; ++e) dp += gr[e] * static_cast<float>(vj[e]);
          float pj, ds;
          if (!pair_grad(p, sm, s, dp, lse, delta, int(b), int(h), int(i), int(j), pj, ds)) continue;
          for (int e = 0; e < p.E; ++e) dq[e] += ds * static_cast<float>(kj[e]);
        }
      }
    }
    T* out = static_cast<T*>(p.dq) + o * p.E;
    for (int e = 0; e < p.E; ++e) out[e] = static_cast<T>(dq[e]);
  }
}

template <int MAXD, class T, class SM, class MM>
__global__ void flex_dkdv_kernel(FlexParams p, SM sm, MM mm) {
  const int64_t kb = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, G = p.Hq / p.Hkv;
  for (int64_t j = kb * p.KB + threadIdx.x; j < min((kb + 1) * p.KB, p.S); j += blockDim.x) {
    float kr[MAXD], vr[MAXD], dk[MAXD], dv[MAXD];
    const T* kj = static_cast<const T*>(p.k) + b * p.k_st[0] + hk * p.k_st[1] + j * p.k_st[2];
    const T* vj = static_cast<const T*>(p.v) + b * p.v_st[0] + hk * p.v_st[1] + j * p.v_st[2];
    for (int e = 0; e < p.E; ++e) kr[e] = static_cast<float>(kj[e]), dk[e] = 0.0f;
    for (int e = 0; e < p.Ev; ++e) vr[e] = static_cast<float>(vj[e]), dv[e] = 0.0f;
    for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
      const int64_t col = mask_row(p, b, h) * p.nKV + kb;
      for (int pass = 0; pass < 2; ++pass) {
        const bool partial = pass == 0;
        const auto [cnt, idx] = p.q_blocks(col, partial);
        for (int32_t c = 0; c < cnt; ++c) {
          const int64_t i0 = static_cast<int64_t>(idx[c]) * p.QB, i1 = min(i0 + p.QB, p.L);
          for (int64_t i = i0; i < i1; ++i) {
            if (partial && !mm(int(b), int(h), int(i), int(j))) continue;
            const T* qi = static_cast<const T*>(p.q) + b * p.q_st[0] + h * p.q_st[1] + i * p.q_st[2];
            const int64_t o = (b * p.Hq + h) * p.L + i;
            const T* gi = static_cast<const T*>(p.dout) + o * p.Ev;
            float s = 0.0f, dp = 0.0f;
            for (int e = 0; e < p.E; ++e) s += static_cast<float>(qi[e]) * kr[e];
            for (int e = 0; e < p.Ev; ++e) dp += static_cast<float>(gi[e]) * vr[e];
            float pj, ds;
            if (!pair_grad(p, sm, s, dp, p.lse[o], p.delta[o], int(b), int(h), int(i), int(j), pj, ds)) continue;
            for (int e = 0; e < p.Ev; ++e) dv[e] += pj * static_cast<float>(gi[e]);
            for (int e = 0; e < p.E; ++e) dk[e] += ds * static_cast<float>(qi[e]);
          }
        }
      }
    }
    const int64_t o = (b * p.Hkv + hk) * p.S + j;
    T* dko = static_cast<T*>(p.dk) + o * p.E;
    T* dvo = static_cast<T*>(p.dv) + o * p.Ev;
    for (int e = 0; e < p.E; ++e) dko[e] = static_cast<T>(dk[e]);
    for (int e = 0; e < p.Ev; ++e) dvo[e] = static_cast<T>(dv[e]);
  }
}

template <class MM>
__global__ void classify_tiles_kernel(MM mm, int64_t Bm, int64_t Hm, int64_t L, int64_t S, int64_t qb, int64_t kb,
                                      uint8_t* out) {
  const int64_t nq = (L + qb - 1) / qb, nk = (S + kb - 1) / kb;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= Bm * Hm * nq * nk) return;
  const int64_t c = t % nk, a = (t / nk) % nq, h = (t / (nk * nq)) % Hm, b = t / (nk * nq * Hm);
  out[t] = static_cast<uint8_t>(attention::classify_tile(mm, int(b), int(h), a * qb, min(L, (a + 1) * qb), c * kb,
                                                         min(S, (c + 1) * kb)));
}

// A learnable score_mod's table gradient, part 1: the thread of (b, h, q block) walks its rows
// and every key in order and adds d loss / d score' = P·(dP − Δ) into its own partial row
// [B, Hq, nQ, bias_row] (the CPU kernel's layout). Masks are evaluated directly (no block lists).
template <class T, class SM, class MM>
__global__ void flex_dbias_partial_kernel(FlexParams p, SM sm, MM mm) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.B * p.Hq * p.nQ) return;
  const int64_t qb = t % p.nQ, h = (t / p.nQ) % p.Hq, b = t / (p.nQ * p.Hq), hk = h / (p.Hq / p.Hkv);
  float* part = p.dbias_partial + t * p.bias_row;
  for (int64_t r = 0; r < p.bias_row; ++r) part[r] = 0.0f;
  const T* k = static_cast<const T*>(p.k) + b * p.k_st[0] + hk * p.k_st[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_st[0] + hk * p.v_st[1];
  for (int64_t i = qb * p.QB; i < min((qb + 1) * p.QB, p.L); ++i) {
    const int64_t o = (b * p.Hq + h) * p.L + i;
    const float lse = p.lse[o], delta = p.delta[o];
    if (lse == -INFINITY) continue;
    const T* qi = static_cast<const T*>(p.q) + b * p.q_st[0] + h * p.q_st[1] + i * p.q_st[2];
    const T* gi = static_cast<const T*>(p.dout) + o * p.Ev;
    for (int64_t j = 0; j < p.S; ++j) {
      if (!mm(int(b), int(h), int(i), int(j))) continue;
      const T* kj = k + j * p.k_st[2];
      const T* vj = v + j * p.v_st[2];
      float s = 0.0f, dp = 0.0f;
      for (int e = 0; e < p.E; ++e) s += static_cast<float>(qi[e]) * static_cast<float>(kj[e]);
      for (int e = 0; e < p.Ev; ++e) dp += static_cast<float>(gi[e]) * static_cast<float>(vj[e]);
      const float x = sm(s * p.scale, int(b), int(h), int(i), int(j));
      if (x == -INFINITY) continue;
      part[sm.bias_index(int(b), int(h), int(i), int(j)) - h * p.bias_row] += __expf(x - lse) * (dp - delta);
    }
  }
}

// Part 2: dbias[h, r] = Σ_b Σ_qb partial[b, h, qb, r], in that order.
__global__ void flex_dbias_reduce_kernel(FlexParams p) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= p.Hq * p.bias_row) return;
  const int64_t h = x / p.bias_row, r = x % p.bias_row;
  float sum = 0.0f;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t qb = 0; qb < p.nQ; ++qb) sum += p.dbias_partial[((b * p.Hq + h) * p.nQ + qb) * p.bias_row + r];
  p.dbias[x] = sum;
}

cudaStream_t flex_stream() { return flex_mma::current_context().stream; }

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
        flex_dbias_reduce_kernel<<<static_cast<unsigned>((cells + 255) / 256), 256, 0, st>>>(p);
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
// register themselves, so a static link would leave it out; the front end refers to this symbol
// (attention/flex_attention.cpp) to keep the file in.
#define KILN_FLEX_CUDA_FILE(name) \
  extern "C" void kiln_flex_cuda_file_##name() {}
// A library mask: its kernels without a score_mod and its GPU BlockMask builder
// (create_block_mask from a MaskSpec on a CUDA device).
#define KILN_FLEX_CUDA_INSTANTIATE_MASK(MM)                  \
  KILN_FLEX_CUDA_INSTANTIATE(::kiln::attention::NoScoreMod, MM) \
  template void classify_tiles<MM>(const MM&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint8_t*);

}  // namespace kiln::kernels::cuda
