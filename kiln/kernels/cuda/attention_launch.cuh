// The host launchers of the mma.sync backward (flex_mma::flex_backward_mma) and of the Hopper
// kernels (flex_wgmma::flex_forward_wgmma / flex_backward_wgmma), over the device-only kernel
// headers. Each Hopper launch is planned first, mods aside (plan_forward / plan_backward: the
// checks of whether it applies, the tensor maps, the grid, the shared memory, the zeroed tile
// counters), then launched with the mods' kernel: here the build-time instantiations, and in
// hopper_plan.cu the plan alone, for the JIT's kernels with run-time mods (kernels/flex_hopper.h).
#pragma once
#include <algorithm>
#include <type_traits>

#include "kiln/core/error.h"
#include "kiln/kernels/cuda/attention_bwd_mma.cuh"
#include "kiln/kernels/cuda/attention_bwd_wgmma.cuh"
#include "kiln/kernels/cuda/attention_fwd_wgmma.cuh"
#include "kiln/kernels/cuda/attention_host.cuh"
#include "kiln/kernels/cuda/tensor_map.h"

namespace kiln::kernels::cuda::flex_mma {
namespace bwd {

// The dK/dV kernel with MT m16 tiles per warp (64·MT keys per CTA), BQ queries per step, EC of
// the E columns per CTA.
template <class NT, int E, int BQ, int MT, class SM, class MM, int EC = E>
void launch_dkdv(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  constexpr int kRows = 16 * MT * kWarps;
  constexpr int smem = (2 * kRows * E + 4 * BQ * E) * 2 + 4 * BQ * 4;
  auto kernel = dkdv_kernel<NT, E, BQ, MT, SM, MM, EC>;
  set_smem(kernel, smem);
  dim3 grid(static_cast<unsigned>((p.S + kRows - 1) / kRows * (E / EC)), static_cast<unsigned>(p.Hkv),
            static_cast<unsigned>(p.B));
  kernel<<<grid, kThreads, smem, st>>>(p, sm, mm);
  KILN_CUDA_CHECK_LAUNCH("flex dkdv_kernel (mma)");
}

// The dQ kernel with MT m16 tiles per warp (64·MT queries per CTA), BK keys per step, EC of the
// E columns per CTA.
template <class NT, int E, int BK, int MT, class SM, class MM, int EC = E>
void launch_dq(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  constexpr int kRows = 16 * MT * kWarps;
  constexpr int smem = (2 * kRows * E + 4 * BK * E) * 2;
  auto kernel = dq_kernel<NT, E, BK, MT, SM, MM, EC>;
  set_smem(kernel, smem);
  dim3 grid(static_cast<unsigned>((p.L + kRows - 1) / kRows * (E / EC)), static_cast<unsigned>(p.Hq),
            static_cast<unsigned>(p.B));
  kernel<<<grid, kThreads, smem, st>>>(p, sm, mm);
  KILN_CUDA_CHECK_LAUNCH("flex dq_kernel (mma)");
}

// Tile shapes: registers decide (see docs/attention.md).
template <class NT, int E, class SM, class MM>
void launch(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  const int64_t rows = p.B * p.Hq * p.L;
  const int64_t threads = rows * (E / 8);
  delta_kernel<NT, E><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, st>>>(p);
  KILN_CUDA_CHECK_LAUNCH("flex delta_kernel (mma)");

  if constexpr (E == 256) {
    // E = 256: dK and dV would be 128 f32 registers a thread each, dQ 128: two CTAs per tile
    // write 128 columns each, both computing the tile's S and dP over all 256 (1.5 × the products
    // of one CTA), with the E = 128 kernels' registers (dK/dV 213, dQ 124). 16-row steps keep
    // shared memory at 96 KB, so two CTAs share an SM (32-row steps: 128 KB, one CTA; H200,
    // B=1 H=16 causal backward: S=16384 117.1 → 106.1–106.8 ms, S=4096 7.54 → 7.46).
    launch_dkdv<NT, E, 16, 1, SM, MM, 128>(p, sm, mm, st);
    launch_dq<NT, E, 16, 1, SM, MM, 128>(p, sm, mm, st);
  } else {
    // dK/dV: one m16 tile per warp (two would need the dK and dV accumulators twice: spills at
    // E = 64 with 32-query steps, 256 registers of accumulators alone at E = 128).
    launch_dkdv<NT, E, E == 128 ? 32 : 64, 1>(p, sm, mm, st);
    // dQ: two m16 tiles per warp (128 queries per CTA, 32-key steps) at E = 64 when the q blocks
    // are multiples of 128; otherwise one (64 queries, 64-key steps).
    if constexpr (E == 64) {
      if (p.QB % 128 == 0) launch_dq<NT, E, 32, 2>(p, sm, mm, st);
      else launch_dq<NT, E, 64, 1>(p, sm, mm, st);
    } else {
      launch_dq<NT, E, 64, 1>(p, sm, mm, st);
    }
  }
}

}  // namespace bwd

// Runs the tensor-core backward (delta, dK/dV, dQ) and returns true, or returns false without
// launching anything when it does not apply (the caller falls back to the SIMT kernels).
template <class T, class SM, class MM>
bool flex_backward_mma(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  using NT = cuda_t<T>;
  if constexpr (std::is_void_v<NT> || attention::is_learnable_v<SM>) {
    return false;  // f32 storage, or a learnable table (dbias is not implemented here)
  } else {
    if (!mma_layout_ok(p, bwd::kTile, bwd::kTile, /*head_dim_256=*/true) || p.L <= 0 || p.S <= 0) return false;
    if (!bwd::aligned16(p.out) || !bwd::aligned16(p.dout) || !bwd::aligned16(p.dq) || !bwd::aligned16(p.dk) ||
        !bwd::aligned16(p.dv))
      return false;
    if (p.E == 64)
      bwd::launch<NT, 64>(p, sm, mm, st);
    else if (p.E == 128)
      bwd::launch<NT, 128>(p, sm, mm, st);
    else
      bwd::launch<NT, 256>(p, sm, mm, st);
    return true;
  }
}

}  // namespace kiln::kernels::cuda::flex_mma

namespace kiln::kernels::cuda::flex_wgmma {

// One launch of a Hopper kernel, its mods aside.
struct HopperLaunch {
  unsigned grid = 0;  // 0: nothing to launch
  int smem = 0;       // dynamic shared memory (bytes)
  bool heads_fastest = false;
  int32_t* tile_counter = nullptr;  // zeroed on the stream by the plan
};

// The forward's tensor maps (the kernel's first four arguments) and launch.
struct FwdPlan {
  CUtensorMap tq, tk, tv, to;  // to: the output, contiguous [B, Hq, L, D], one warpgroup's 64 rows a box
  int head_dim = 0;            // the kernel's D
  HopperLaunch launch;
};

// The Hopper forward for 16-bit storage CT, mods aside: false when it does not apply (nothing was
// done; the caller uses another kernel), else true with plan.launch.grid = 0 when there is
// nothing to write, or the plan of the launch, the tile counter zeroed on `st`.
template <class CT> bool plan_forward(const FlexParams& p, FwdPlan& plan, cudaStream_t st) {
  if (!mma_layout_ok(p, kBM, kBN) || p.tile_counters == nullptr) return false;
  if (p.B == 0 || p.Hq == 0 || p.L == 0) return true;  // nothing to write
  constexpr bool kBf16 = std::is_same_v<CT, __nv_bfloat16>;
  const int D = static_cast<int>(p.E);
  const int smem = D == 64 ? FwdSmem<64>::kBytes : FwdSmem<128>::kBytes;
  const DeviceContext& ctx = current_context();
  if (ctx.max_shared_per_block < static_cast<size_t>(smem)) return false;  // fall back
  if (!wg::encode_tensor_map_16bit(&plan.tq, kBf16, p.q, p.B, p.Hq, p.L, D, p.q_st[0], p.q_st[1], p.q_st[2], kBM) ||
      !wg::encode_tensor_map_16bit(&plan.tk, kBf16, p.k, p.B, p.Hkv, p.S, D, p.k_st[0], p.k_st[1], p.k_st[2], kBN) ||
      !wg::encode_tensor_map_16bit(&plan.tv, kBf16, p.v, p.B, p.Hkv, p.S, D, p.v_st[0], p.v_st[1], p.v_st[2], kBN) ||
      !wg::encode_tensor_map_16bit(&plan.to, kBf16, p.out, p.B, p.Hq, p.L, D, p.Hq * p.L * D, p.L * D, D, 64))
    return false;
  const int64_t q_tiles = (p.L + kBM - 1) / kBM, tiles = q_tiles * p.B * p.Hq;
  if (tiles >= (int64_t{1} << 31)) return false;  // tile indices are int32 (tile_rank)
  plan.head_dim = D;
  plan.launch.grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(tiles, ctx.sm_count)));
  plan.launch.smem = smem;
  plan.launch.heads_fastest = heads_fastest_order(q_tiles, ctx.sm_count);
  plan.launch.tile_counter = p.tile_counters;
  KILN_CUDA_CHECK(cudaMemsetAsync(p.tile_counters, 0, sizeof(int32_t), st));
  return true;
}

// The Hopper forward when it applies (see the top of attention_fwd_wgmma.cuh); false: use
// another kernel.
template <class T, class SM, class MM>
bool flex_forward_wgmma(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  using CT = cuda_t<T>;
  if constexpr (std::is_void_v<CT>) {
    return false;
  } else {
    FwdPlan plan;
    if (!plan_forward<CT>(p, plan, st)) return false;
    if (plan.launch.grid == 0) return true;
    auto run = [&]<int D>() {
      auto kernel = flex_fwd_wgmma_kernel<CT, D, SM, MM>;
      const HopperLaunch& l = plan.launch;
      set_smem(kernel, l.smem);
      kernel<<<l.grid, kThreads, l.smem, st>>>(plan.tq, plan.tk, plan.tv, plan.to, p, sm, mm, l.heads_fastest,
                                                l.tile_counter);
      KILN_CUDA_CHECK_LAUNCH("flex_fwd_wgmma_kernel");
    };
    plan.head_dim == 64 ? run.template operator()<64>() : run.template operator()<128>();
    return true;
  }
}

// The backward's two passes: dQ first (it writes the delta that the dK/dV pass reads).
struct BwdPlan {
  BwdMaps q_side, kv_side;
  int head_dim = 0;
  HopperLaunch dq, dkdv;  // grid 0: nothing to launch
};

namespace detail {
// Encodes the maps of both passes (out, dq, dk, dv are contiguous [B, H, rows, D]); false when
// one cannot be described.
template <class CT> bool bwd_maps(const FlexParams& p, int64_t D, BwdMaps& kv_side, BwdMaps& q_side) {
  constexpr bool kBf16 = std::is_same_v<CT, __nv_bfloat16>;
  const int64_t go_b = p.Hq * p.L * D, go_h = p.L * D;  // dO is contiguous [B, Hq, L, D]
  auto map16 = [&](CUtensorMap& m, const void* base, int64_t H, int64_t rows, int64_t sb, int64_t sh, int64_t sr,
                   int box) { return wg::encode_tensor_map_16bit(&m, kBf16, base, p.B, H, rows, D, sb, sh, sr, box); };
  return map16(kv_side.r0, p.k, p.Hkv, p.S, p.k_st[0], p.k_st[1], p.k_st[2], kBwdRows) &&
         map16(kv_side.r1, p.v, p.Hkv, p.S, p.v_st[0], p.v_st[1], p.v_st[2], kBwdRows) &&
         map16(kv_side.s0, p.q, p.Hq, p.L, p.q_st[0], p.q_st[1], p.q_st[2], kBwdStep) &&
         map16(kv_side.s1, p.dout, p.Hq, p.L, go_b, go_h, D, kBwdStep) &&
         map16(q_side.r0, p.q, p.Hq, p.L, p.q_st[0], p.q_st[1], p.q_st[2], kBwdRows) &&
         map16(q_side.r1, p.dout, p.Hq, p.L, go_b, go_h, D, kBwdRows) &&
         map16(q_side.s0, p.k, p.Hkv, p.S, p.k_st[0], p.k_st[1], p.k_st[2], kBwdStep) &&
         map16(q_side.s1, p.v, p.Hkv, p.S, p.v_st[0], p.v_st[1], p.v_st[2], kBwdStep) &&
         map16(kv_side.o0, p.dk, p.Hkv, p.S, p.Hkv * p.S * D, p.S * D, D, 64) &&
         map16(kv_side.o1, p.dv, p.Hkv, p.S, p.Hkv * p.S * D, p.S * D, D, 64) &&
         map16(q_side.o0, p.dq, p.Hq, p.L, p.Hq * p.L * D, p.L * D, D, 64) &&
         map16(q_side.o1, p.out, p.Hq, p.L, p.Hq * p.L * D, p.L * D, D, 64);
}
// One pass's persistent grid (KV_SIDE: dK/dV), at most one CTA per SM.
inline HopperLaunch bwd_launch(const FlexParams& p, bool kv_side, int smem, int sms, int32_t* tile_counter) {
  const int64_t rows = kv_side ? p.S : p.L;
  const int64_t row_tiles = (rows + kBwdRows - 1) / kBwdRows;
  const int64_t tiles = row_tiles * (kv_side ? p.Hkv : p.Hq) * p.B;  // < 2^31 (checked by plan_backward)
  // tiles == 0 (B = 0 or Hq = 0): nothing to write (dK/dV with Hq = 0 get zeros from their empty walks)
  return HopperLaunch{static_cast<unsigned>(std::min<int64_t>(tiles, sms)), smem, heads_fastest_order(row_tiles, sms),
                      tile_counter};
}
}  // namespace detail

// The Hopper backward for 16-bit storage CT, mods aside (a learnable score_mod is the caller's to
// refuse): false when it does not apply (nothing was done), else the plan of both passes, the tile
// counters zeroed on `st`.
template <class CT> bool plan_backward(const FlexParams& p, BwdPlan& plan, cudaStream_t st) {
  if (!mma_layout_ok(p, kBwdRows, kBwdRows) || p.L <= 0 || p.S <= 0 || p.tile_counters == nullptr) return false;
  namespace bwd = flex_mma::bwd;
  if (!bwd::aligned16(p.out) || !bwd::aligned16(p.dout) || !bwd::aligned16(p.dq) || !bwd::aligned16(p.dk) ||
      !bwd::aligned16(p.dv) || p.B * p.Hq * p.L >= (int64_t{1} << 31) ||
      (p.S + kBwdRows - 1) / kBwdRows * p.Hkv * p.B >= (int64_t{1} << 31))  // the dK/dV grid
    return false;
  const int D = static_cast<int>(p.E);
  const int smem_dq = D == 64 ? BwdSmem<64, false>::kBytes : BwdSmem<128, false>::kBytes;
  const int smem_dkdv = D == 64 ? BwdSmem<64, true>::kBytes : BwdSmem<128, true>::kBytes;
  const DeviceContext& ctx = current_context();
  if (ctx.max_shared_per_block < static_cast<size_t>(std::max(smem_dq, smem_dkdv)) ||
      !detail::bwd_maps<CT>(p, D, plan.kv_side, plan.q_side))
    return false;
  plan.head_dim = D;
  KILN_CUDA_CHECK(cudaMemsetAsync(p.tile_counters, 0, 2 * sizeof(int32_t), st));
  plan.dq = detail::bwd_launch(p, false, smem_dq, ctx.sm_count, p.tile_counters + 1);
  plan.dkdv = detail::bwd_launch(p, true, smem_dkdv, ctx.sm_count, p.tile_counters);
  return true;
}

// The Hopper backward when it applies (see the top of attention_bwd_wgmma.cuh); false: nothing
// was launched.
template <class T, class SM, class MM>
bool flex_backward_wgmma(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  using CT = cuda_t<T>;
  if constexpr (std::is_void_v<CT> || attention::is_learnable_v<SM>) {
    return false;
  } else {
    BwdPlan plan;
    if (!plan_backward<CT>(p, plan, st)) return false;
    auto pass = [&]<int D, bool KV_SIDE>(const BwdMaps& maps, const HopperLaunch& l) {
      if (l.grid == 0) return;
      auto kernel = flex_bwd_wgmma_kernel<CT, D, KV_SIDE, SM, MM>;
      set_smem(kernel, l.smem);
      kernel<<<l.grid, kThreads, l.smem, st>>>(maps, p, sm, mm, l.heads_fastest, l.tile_counter);
      KILN_CUDA_CHECK_LAUNCH("flex_bwd_wgmma_kernel");
    };
    auto run = [&]<int D>() {
      pass.template operator()<D, false>(plan.q_side, plan.dq);
      pass.template operator()<D, true>(plan.kv_side, plan.dkdv);
    };
    plan.head_dim == 64 ? run.template operator()<64>() : run.template operator()<128>();
    return true;
  }
}

}  // namespace kiln::kernels::cuda::flex_wgmma
