// The Hopper FlexAttention forward (FlashAttention-3 style: TMA, wgmma, warp specialisation) for
// bf16 / f16 with E = Ev ∈ {64, 128} and BlockMask blocks that are multiples of 128:
// flex_forward_wgmma, which returns false when it does not apply so that the caller falls back
// to the mma.sync kernel (attention_fwd_mma.cuh). Also what the Hopper backward shares: the
// row-tile TMA helper load_rows_tma (store_rows_tma is wgmma.cuh's), and the tile order
// (tile_rank, heads_fastest_order, claim_tile).
//
// NOTE [flex forward wgmma]
// - A persistent grid (one CTA per SM) walks the (query tile, b, h) tiles heaviest first
//   (the last query tiles, which hold the most blocks under causal masks, come first): a CTA
//   takes tile blockIdx.x, then claims the next from a counter (the producer, as it gets to
//   it); the heads fastest when one head's query tiles do not fill the GPU, else head-major, so
//   the CTAs running together stream one head's K/V through L2 (the backward's rule, BwdTile).
//   A static stride of gridDim.x let the CTAs drift apart over heads: at S = 32768 causal
//   (H200, ncu) the forward read 5.6 GB from DRAM (L2 hits 76 %) in 6.52 ms; claimed, 0.44 GB
//   (97 %) in 6.17 ms.
// - A CTA is 3 warpgroups: two consumers of 64 query rows each (a 128-row tile) and a producer
//   whose first lane issues the TMA copies; setmaxnreg moves the producer's registers to the
//   consumers (240 each: O, S and P of a 64 × 128 tile stay in registers). Shared memory holds Q (one buffer) and
//   kStages stages of (K, V) sub-tiles of 128 keys, all 128-byte swizzled (wgmma.cuh).
//   mbarriers hand buffers over: q_full / kv_full[s] complete when the copies land
//   (transaction bytes); q_empty / kv_empty[s] complete when the 8 consumer warps are done with
//   them. The producer runs ahead by kStages sub-tiles and loads the next tile's Q as soon as
//   the last S of the current tile is computed, so copies overlap the math across tiles too.
//   The two consumer warpgroups only meet at the buffers, so one's softmax overlaps the other's
//   mma. The producer alone reads the block lists: it leaves each tile's step counts and each
//   stage's first key in shared memory, published by the same barriers (q_full, kv_full[s]),
//   so the consumers never wait on a global load before their stores. Lane 0 of each consumer
//   warp reads those slots for its warp (wg::warp_read_slot): it is the lane that arrives on
//   q_empty / kv_empty, so its arrive orders the read before the producer rewrites the slot.
// - Per sub-tile a consumer warpgroup computes S = Q·Kᵀ (64 × 128, D / 16 wgmma from shared
//   memory), applies score_mod (and mask_mod on partial blocks, bounds where the tile crosses L
//   or S; the identity score_mod with scale > 0 puts its scale into the exponent, so the mask
//   and bounds only select) in registers, updates the online softmax (exp2, f32) and
//   accumulates O += P·V with P rounded to 16 bits and fed from registers (128 / 16 wgmma, V
//   read transposed). Rows beyond L and keys beyond S arrive as zeros from the TMA and are
//   masked. At the end O is divided by the row sum and lse = m + log(l) is written; a row with
//   nothing kept gets O = 0, lse = −inf. O leaves by a TMA store through the K buffer of the
//   tile's last stage (store_rows_tma), which both warpgroups' last S have finished reading;
//   that stage's kv_empty then also waits for the store to have read it (release_held).
// - GQA: K/V of head h / (Hq / Hkv) through the tensor maps' strides (no copies).
#pragma once
#include "kiln/kernels/device_std.h"
#include "kiln/kernels/flex_mods.h"
#include "kiln/kernels/cuda/attention_mma_common.cuh"
#include "kiln/kernels/cuda/wgmma.cuh"

namespace kiln::kernels::cuda::flex_wgmma {

using namespace ::kiln::kernels::cuda::flex_mma;
namespace wg = ::kiln::kernels::cuda::wgmma;

inline constexpr int kBM = 128;  // query rows per tile (two warpgroups of 64)
inline constexpr int kBN = 128;  // keys per sub-tile
inline constexpr int kConsumerWarps = 8;
inline constexpr int kThreads = 32 * (kConsumerWarps + 4);  // + the producer warpgroup
// Registers per thread after setmaxnreg: the producer gives its share to the consumers. The
// pool is what the CTA holds at entry (__launch_bounds__(kThreads, 1): 65536 / 384 rounded down
// to a multiple of 8 = 168 per thread); setmaxnreg.inc waits until the pool has the registers,
// so a split beyond it would hang every CTA.
inline constexpr int kProducerRegs = 24, kConsumerRegs = 240;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * ((65536 / kThreads) & ~7),
              "the register split must fit the CTA's registers at entry");


// Shared-memory layout (byte offsets from a 1024-byte-aligned base).
template <int D> struct FwdSmem {
  static constexpr int kStages = D == 128 ? 3 : 4;
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kKVBytes = kBN * D * 2;  // one of K, V
  static constexpr int kK = kQBytes;            // stage s: K at kK + 2·s·kKVBytes, V right after
  static constexpr int kBar = kK + 2 * kStages * kKVBytes;
  // int32 written by the producer for the consumers: the tile's n_part and n (published by
  // q_full), then each stage's first key (published by kv_full[s]), then the tile (published by
  // q_full; −1: no more tiles).
  static constexpr int kInfo = kBar + (2 + 2 * kStages) * 8;
  static constexpr int kTileSlot = kInfo + (2 + kStages) * 4;
  static constexpr int kBytes = kTileSlot + 4 + 1024;  // + slack to align the base
};

// The order of the Hopper kernels' tiles (this forward's and the backward's, BwdTile): tile t of
// n_bh (b, head) pairs with n_row_tiles each is the rank-th of pair bh (rank 0: the pair's
// heaviest). With heads_fastest (one head's row tiles do not fill the GPU: heads_fastest_order)
// t runs over the pairs first, so every head's heaviest tiles start together; else head-major,
// so the CTAs running together stream one head's rows through L2. Head-major at S = 32768
// causal (256 query tiles a head, 132 SMs; H200, ncu): the forward read 6.6 GB from DRAM
// instead of 14.0 and ran 6.58 ms instead of 6.89; heads fastest at S = 8192 (64 tiles a head):
// forward + backward 1.85 ms against 2.12 head-major.
// 32-bit arithmetic (the launches keep the tile count under 2^31): 64-bit divisions are calls
// whose clobbered registers the forward's 24-register producer spilled.
struct TileRank {
  uint32_t bh, rank;
};
__device__ __forceinline__ TileRank tile_rank(uint32_t t, uint32_t n_row_tiles, uint32_t n_bh, bool heads_fastest) {
  return heads_fastest ? TileRank{t % n_bh, t / n_bh} : TileRank{t / n_row_tiles, t % n_row_tiles};
}
inline bool heads_fastest_order(int64_t row_tiles, int sm_count) { return row_tiles < sm_count; }
// The persistent grids' tiles after the first (blockIdx.x): claimed from a counter that starts
// at 0, so the CTAs running together keep to neighbouring tiles in that order.
__device__ __forceinline__ int32_t claim_tile(int32_t* tile_counter) {
  return static_cast<int32_t>(gridDim.x) + atomicAdd(tile_counter, 1);
}

// The forward's tile of linear index t: (b, h, first query row), the last query tiles (under
// causal masks the heaviest) first.
struct FwdTile {
  int b, h;
  int64_t q0;
};
__device__ __forceinline__ FwdTile fwd_tile(const FlexParams& p, int32_t t, int64_t n_qtiles, bool heads_fastest) {
  const uint32_t hq = static_cast<uint32_t>(p.Hq);
  const TileRank tr = tile_rank(t, static_cast<uint32_t>(n_qtiles), static_cast<uint32_t>(p.B) * hq, heads_fastest);
  return {static_cast<int>(tr.bh / hq), static_cast<int>(tr.bh % hq), (n_qtiles - 1 - tr.rank) * kBM};
}

// 2^x on the special-function unit (one MUFU.EX2; -inf → 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Issues O += P·V for one 128-key sub-tile: P from registers (pa), V at shared address v_base,
// read MN-major (transposed). The caller fences, commits and waits.
template <class T, int D>
__device__ __forceinline__ void pv_issue(float (&o)[D / 8][4], const uint32_t (&pa)[kBN / 16][4], uint32_t v_base) {
  const uint64_t v = wg::desc_sw128(v_base, kBN * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) wg::wgmma_rs<T, D, 1>(o, pa[kk], wg::desc_advance(v, kk * 16 * 128), 1);
}

// A tile of ROWS rows × 64·GROUPS columns at tensor coordinates (row, head, b) of `map` into
// swizzled shared memory at `dst` (one TMA box per 64-column group; NOTE [swizzled tiles for
// wgmma and TMA]), completing on `bar` (both 32-bit shared addresses).
template <int GROUPS, int ROWS>
__device__ __forceinline__ void load_rows_tma(uint32_t dst, const CUtensorMap* map, uint32_t bar, int row, int head,
                                              int b) {
#pragma unroll
  for (int g = 0; g < GROUPS; ++g) wg::tma_load_4d(dst + g * ROWS * 128, map, bar, 64 * g, row, head, b);
}

template <class T, int D, class SM, class MM>
__global__ void __launch_bounds__(kThreads, 1)
    flex_fwd_wgmma_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                          const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap to,
                          FlexParams p, SM sm, MM mm, bool heads_fastest, int32_t* tile_counter) {
  using Smem = FwdSmem<D>;
  constexpr int kStages = Smem::kStages;
  constexpr int kGroups = D / 64;  // 64-column groups of a row (one TMA box each)
  extern __shared__ unsigned char fwd_wgmma_smem[];
  unsigned char* smem = wg::align_1024(fwd_wgmma_smem);
  // Shared addresses as 32-bit offsets from the base (wgmma.cuh's mbarriers), the producer's
  // slots also as pointers for its stores.
  const uint32_t base = wg::smem_u32(smem);
  const uint32_t q_full = base + Smem::kBar, q_empty = q_full + 8;
  auto kv_full = [&](uint32_t s) { return q_full + 16 + 8 * s; };
  auto kv_empty = [&](uint32_t s) { return q_full + 16 + 8 * (kStages + s); };
  const uint32_t tile_slot = base + Smem::kTileSlot;
  auto info = [&](uint32_t i) { return base + Smem::kInfo + 4 * i; };  // the address of int32 slot i
  int32_t* info_w = reinterpret_cast<int32_t*>(smem + Smem::kInfo);
  int32_t* tile_slot_w = reinterpret_cast<int32_t*>(smem + Smem::kTileSlot);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    wg::mbar_init(q_full, 1);
    wg::mbar_init(q_empty, kConsumerWarps);
    for (int s = 0; s < kStages; ++s) wg::mbar_init(kv_full(s), 1), wg::mbar_init(kv_empty(s), kConsumerWarps);
    wg::mbar_init_fence();
  }
  __syncthreads();

  const int64_t n_qtiles = (p.L + kBM - 1) / kBM, n_tiles = n_qtiles * p.B * p.Hq;
  const int group = static_cast<int>(p.Hq) / static_cast<int>(p.Hkv);  // 32-bit: a 64-bit division is a call

  if (warp >= kConsumerWarps) {
    // ---- producer: one lane of the third warpgroup issues every copy ----
    wg::setmaxnreg_dec<kProducerRegs>();
    if (warp != kConsumerWarps || lane != 0) return;
    uint32_t it = 0;
    // Tile blockIdx.x, then the ones claimed from tile_counter (NOTE [flex forward wgmma]).
    int32_t t = static_cast<int32_t>(blockIdx.x);
    for (uint32_t q_phase = 1;; q_phase ^= 1) {
      wg::mbar_wait(q_empty, q_phase);
      if (t >= n_tiles) {
        tile_slot_w[0] = -1, wg::mbar_arrive(q_full);
        break;
      }
      const FwdTile tile = fwd_tile(p, t, n_qtiles, heads_fastest);
      const KvSteps<kBN> steps(p, tile.b, tile.h, tile.q0);
      const int hk = static_cast<int>(tile.h / group);
      info_w[0] = steps.n_part, info_w[1] = steps.n, tile_slot_w[0] = t;  // released to the consumers by the arrive
      wg::mbar_arrive_expect_tx(q_full, Smem::kQBytes);
      load_rows_tma<kGroups, kBM>(base, &tq, q_full, static_cast<int>(tile.q0), tile.h, tile.b);
      for (int s = 0; s < steps.n; ++s, ++it) {
        const uint32_t stage = it % kStages, phase = (it / kStages) & 1;
        wg::mbar_wait(kv_empty(stage), phase ^ 1);
        const int kv0 = static_cast<int>(steps.kv0(p, s));
        info_w[2 + stage] = kv0;  // released to the consumers by the arrive
        wg::mbar_arrive_expect_tx(kv_full(stage), 2 * Smem::kKVBytes);
        const uint32_t sk = base + Smem::kK + stage * 2 * Smem::kKVBytes;
        load_rows_tma<kGroups, kBN>(sk, &tk, kv_full(stage), kv0, hk, tile.b);
        load_rows_tma<kGroups, kBN>(sk + Smem::kKVBytes, &tv, kv_full(stage), kv0, hk, tile.b);
      }
      t = claim_tile(tile_counter);
    }
    return;
  }

  // ---- consumers: warpgroup wgi owns rows 64·wgi .. 64·wgi + 63 of the tile ----
  wg::setmaxnreg_inc<kConsumerRegs>();
  const int wgi = warp >> 2, wq = warp & 3, g = lane >> 2, t4 = lane & 3;
  const int L = static_cast<int>(p.L), S = static_cast<int>(p.S);
  const uint32_t q_base = base + wgi * 64 * 128;
  constexpr int kNt = kBN / 8, kOt = D / 8;
  constexpr bool kIdentity = dev::is_same_v<SM, attention::NoScoreMod>;
  const bool issuer = wq == 0 && lane == 0;  // stores this warpgroup's O rows
  // The stage whose K buffer took the previous tile's O: its release waits until the store has
  // read it (release_held, a step into the next tile).
  int held_stage = -1;
  auto release_held = [&] {
    if (held_stage < 0) return;
    if (issuer) wg::bulk_wait_read<0>(), wg::mbar_arrive(kv_empty(held_stage));
    held_stage = -1;
  };
  uint32_t it = 0;
  for (uint32_t tc = 0;; ++tc) {
    wg::mbar_wait(q_full, tc & 1);
    const int32_t t = wg::warp_read_slot(tile_slot);
    if (t < 0) break;
    const FwdTile tile = fwd_tile(p, t, n_qtiles, heads_fastest);
    const int row0 = static_cast<int>(tile.q0) + 64 * wgi + 16 * wq;
    const bool q_tail = tile.q0 + kBM > p.L;
    float o[kOt][4];
#pragma unroll
    for (int j = 0; j < kOt; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    // The walk's length from the producer (it reads the block lists; the consumers never touch
    // global memory before the store).
    const int n_part = wg::warp_read_slot(info(0)), n_steps = wg::warp_read_slot(info(1));
    if (n_steps == 0 && lane == 0) wg::mbar_arrive(q_empty);
    float sc[kNt][4];              // S of this step, then its P in f32
    uint32_t pa[kBN / 16][4];      // P of the previous step, 16-bit, as A fragments
    float alpha[2], sum[2];
    // Issues S = Q·Kᵀ of step s (D / 16 k-steps, both operands K-major) into sc.
    auto issue_s = [&](uint32_t k_base) {
      const uint64_t q = wg::desc_sw128(q_base, 16, 1024), k = wg::desc_sw128(k_base, 16, 1024);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t off = (kk & 3) * 32;  // k16 step within the 128-byte row
        wg::wgmma_ss<T, kBN>(sc, wg::desc_advance(q, (kk >> 2) * kBM * 128 + off),
                             wg::desc_advance(k, (kk >> 2) * kBN * 128 + off), kk > 0 ? 1 : 0);
      }
    };
    // Mods and the online softmax of step s on sc (P in place of S); alpha and sum for rows
    // g (r = 0) and g + 8 (r = 1). score_mod always, mask_mod on partial blocks, bounds where
    // the tile crosses L or S. The identity score_mod needs no mod: its scale goes into the
    // exponent (scale > 0 keeps the row max where it is), and only the mask and bounds, if any,
    // are applied.
    // kv_tile: the first key of step s, from the producer's slot of its stage.
    auto softmax = [&](int s, int kv_tile) {
      const bool use_mask = s < n_part, bounds = q_tail || kv_tile + kBN > S;
      const bool fast = kIdentity && p.scale > 0.0f;
      // kScore: score_mod(scale · x); without it (fast) the elements kept stay raw dot products.
      auto mods = [&](auto score) {
        with_mask_flags(use_mask, bounds, [&]<bool kMask, bool kBounds>() {
#pragma unroll
          for (int j = 0; j < kNt; ++j)
            apply_mods<kMask, kBounds, decltype(score)::value>(sc[j], sm, mm, p.scale, tile.b, tile.h, row0,
                                                               kv_tile + 8 * j, lane, L, S);
        });
      };
      if (!fast)
        mods(dev::true_type{});
      else if (use_mask || bounds)
        mods(dev::false_type{});
      const float mul = fast ? p.scale * kLog2e : kLog2e;  // exponent = x·mul − m·kLog2e
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < kNt; ++j) mx = fmaxf(mx, fmaxf(sc[j][2 * r], sc[j][2 * r + 1]));
        mx = fmaxf(m[r], quad_max(mx) * (mul / kLog2e));           // in scaled-score units
        const float base = mx == -INFINITY ? 0.0f : mx * kLog2e;  // nothing kept yet: no inf − inf
        alpha[r] = m[r] == -INFINITY ? 0.0f : fast_exp2(m[r] * kLog2e - base);
        m[r] = mx;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kNt; ++j) {
          sc[j][2 * r] = fast_exp2(fmaf(sc[j][2 * r], mul, -base));
          sc[j][2 * r + 1] = fast_exp2(fmaf(sc[j][2 * r + 1], mul, -base));
          acc += sc[j][2 * r] + sc[j][2 * r + 1];
        }
        sum[r] = acc;
      }
    };
    // Rescales O and l by alpha and hands P over as 16-bit A fragments.
    auto rescale_and_pack = [&] {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
        for (int j = 0; j < kOt; ++j) o[j][2 * r] *= alpha[r], o[j][2 * r + 1] *= alpha[r];
      }
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) c_to_a<T>(pa[kk], sc[2 * kk], sc[2 * kk + 1]);
    };
    auto k_of = [&](uint32_t stage) { return base + Smem::kK + stage * 2 * Smem::kKVBytes; };

    if (n_steps > 0) {
      // Step 0: S, softmax, nothing to overlap with yet.
      uint32_t stage_prev = it % kStages;
      wg::mbar_wait(kv_full(stage_prev), (it / kStages) & 1);
      const int kv_tile0 = wg::warp_read_slot(info(2 + stage_prev));
      wg::fence_operands(sc);
      wg::fence();
      issue_s(k_of(stage_prev));
      wg::commit();
      wg::wait<0>();
      wg::fence_operands(sc);
      release_held();
      if (n_steps == 1 && lane == 0) wg::mbar_arrive(q_empty);
      softmax(0, kv_tile0);
      rescale_and_pack();
      ++it;
      // Steps 1 ..: issue S of step s and the previous step's O += P·V, so that the tensor cores
      // run P·V while this warpgroup does the softmax of S.
      for (int s = 1; s < n_steps; ++s, ++it) {
        const uint32_t stage = it % kStages;
        wg::mbar_wait(kv_full(stage), (it / kStages) & 1);
        const int kv_tile = wg::warp_read_slot(info(2 + stage));
        wg::fence_operands(sc);
        wg::fence_operands(o);
        wg::fence_operands(pa);
        wg::fence();
        issue_s(k_of(stage));
        wg::commit();
        pv_issue<T, D>(o, pa, k_of(stage_prev) + Smem::kKVBytes);
        wg::commit();
        wg::wait<1>();  // S landed; P·V may still run
        wg::fence_operands(sc);
        if (s == n_steps - 1 && lane == 0) wg::mbar_arrive(q_empty);  // Q is free for the next tile
        softmax(s, kv_tile);
        wg::wait<0>();  // the previous P·V is done: release its stage
        wg::fence_operands(o);
        wg::fence_operands(pa);
        if (lane == 0) wg::mbar_arrive(kv_empty(stage_prev));
        rescale_and_pack();
        stage_prev = stage;
      }
      // The last step's P·V.
      wg::fence_operands(o);
      wg::fence_operands(pa);
      wg::fence();
      pv_issue<T, D>(o, pa, k_of(stage_prev) + Smem::kKVBytes);
      wg::commit();
      wg::wait<0>();
      wg::fence_operands(o);
      wg::fence_operands(pa);
    }
    release_held();  // a tile with no steps

    // Normalise, store O and lse (rows ≥ L not written).
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lt = quad_sum(l[r]);
      inv[r] = lt != 0.0f ? 1.0f / lt : 0.0f;  // 0: nothing kept; NaN (a NaN score) stays NaN
      const int64_t i = row0 + g + 8 * r;
      if (t4 == 0 && i < p.L)
        p.lse[(static_cast<int64_t>(tile.b) * p.Hq + tile.h) * p.L + i] = lt != 0.0f ? m[r] + logf(lt) : -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < kOt; ++j) o[j][0] *= inv[0], o[j][1] *= inv[0], o[j][2] *= inv[1], o[j][3] *= inv[1];
    if (n_steps > 0) {
      // O leaves through the K buffer of the tile's last stage: nothing reads it once both
      // warpgroups have computed their last S (q_empty's completion for this tile), and the
      // producer refills it only after kv_empty, which this warpgroup's first warp signals once
      // the store has read it (release_held); the other warps signal now.
      const uint32_t last = (it - 1) % kStages;
      wg::mbar_wait(q_empty, tc & 1);
      wg::store_rows_tma<T, kOt, kBN>(o, smem + Smem::kK + last * 2 * Smem::kKVBytes, wgi, lane, issuer, &to,
                                  static_cast<int>(tile.q0), tile.h, tile.b);
      if (lane == 0 && wq != 0) wg::mbar_arrive(kv_empty(last));
      held_stage = static_cast<int>(last);
    } else {  // nothing was kept: zeros, stored directly
      T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(tile.b) * p.Hq + tile.h) * p.L * D;
#pragma unroll
      for (int j = 0; j < kOt; ++j) store_c<T>(out, D, o[j], row0, 8 * j, p.L, lane);
    }
  }
  if (issuer) wg::bulk_wait_read<0>();  // the last store has read shared memory before the CTA ends
}

}  // namespace kiln::kernels::cuda::flex_wgmma
