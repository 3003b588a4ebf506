// The Hopper FlexAttention backward (TMA, wgmma, warp specialisation) for bf16 / f16 with
// E = Ev ∈ {64, 128}, BlockMask blocks multiples of 128 and score mods without a learnable
// table: flex_backward_wgmma, which returns false when it does not apply (the caller then runs
// the mma.sync backward of attention_bwd_mma.cuh). Bitwise deterministic, like that one: each
// output element has one owner that reduces in a fixed order. Two launches:
//   1. dQ: a tile is 128 queries of one (b, q head), walking the kv_blocks list of its Q block,
//      64 keys a step; it first computes its rows' delta = rowsum(dO ∘ O) − dlse (O arrives in
//      the tile's first stage, dO is resident) and writes it for pass 2;
//   2. dK/dV: a tile is 128 keys of one (b, kv head); its walk covers the q_blocks lists of its
//      KV block for each query head of the GQA group (partial blocks first), 64 queries a step.
//
// NOTE [flex backward wgmma] Both passes are one kernel template (KV_SIDE = true: dK/dV):
// - A persistent grid (at most one CTA per SM) whose CTAs claim tiles from a counter, heaviest
//   first (BwdTile). The next tile's pair loads while the current one is walked, and the
//   results leave by TMA stores while the next tile runs, so neither a tile's loads nor its
//   stores stall the tensor cores (the sliding-window case, ~6 steps a tile, spent most of its
//   time there with one CTA per tile): dK/dV has two resident buffers, dQ one, given back as
//   soon as its rows are in registers, and a staging tile for its store (BwdSmem).
// - Three warpgroups: two consumers own 64 rows each of the tile's resident pair (dK/dV: K and
//   V; dQ: Q and dO), a producer whose first lane issues the TMA copies (the resident pair per
//   tile, then per step the streamed pair: dK/dV: Q and dO of 64 queries, with their lse and
//   delta stored by the producer warp's lanes; dQ: K and V of 64 keys) into kStages
//   shared-memory stages handed over by mbarriers
//   (wgmma.cuh; the forward's scheme, NOTE [flex forward wgmma]). Only the producer walks the
//   block lists: each stage carries its step (first row, head, pass) in a shared-memory slot,
//   and a last stage without copies ends the walk, so the consumers never wait on a global load.
// - Per step a consumer warpgroup computes two 64 × 64 products, A = its rows of the resident
//   pair (from shared memory in dK/dV; in the dQ pass from registers, read once a tile),
//   B = the streamed pair: X = R0·S0ᵀ and dX = R1·S1ᵀ,
//   i.e. Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (dK/dV) or S = Q·Kᵀ and dP = dO·Vᵀ (dQ); then in registers
//   P = exp(score_mod(scale·S) − lse) and dS = P ∘ (dP − delta) · dscore · scale (mask_mod on
//   partial blocks, bounds on tiles crossing L or S; the identity score_mod puts its scale into
//   the exponent, with lse·log2 e precomputed per row, and leaves it out of dS: dK or dQ takes
//   it once at the end; the mask and bounds then only select), and accumulates with A
//   from registers and B = the streamed tiles read transposed: dV += Pᵀ·dO and dK += dSᵀ·Q, or
//   dQ += dS·K. The dK/dV pass at E = 128 with the identity score_mod issues dV's products as
//   soon as P is packed and computes dS while they run (kSplitAcc: dK/dV 12.25 → 11.84 ms at
//   S = 32768 causal, H200). The accumulators (f32, 64 × E per warpgroup: two for dK/dV) leave once per
//   tile: rounded to 16 bits into a swizzled tile, then one TMA store per 64-column group. dK/dV
//   writes them into the warpgroup's own rows of the resident pair (its products no longer read
//   them), and the buffer goes back to the producer (res_empty) once the stores have read it,
//   checked a step into the next tile; dQ into its staging tile, once the previous tile's store
//   has read it.
#pragma once
#include "kiln/kernels/cuda/attention_bwd_mma.cuh"
#include "kiln/kernels/cuda/attention_fwd_wgmma.cuh"

namespace kiln::kernels::cuda::flex_wgmma {

inline constexpr int kBwdRows = 128;  // resident rows per CTA (two warpgroups of 64)
inline constexpr int kBwdStep = 64;   // streamed rows per step
inline constexpr int32_t kWalkEnd = -1;  // a stage slot's meta after the walk's last step

template <int D, bool KV_SIDE> struct BwdSmem {
  // dK/dV: two resident buffers (its products read K and V from shared memory; the next tile's
  // pair loads into the other while one is used), and each tile's results leave through its own
  // resident rows; with the stages that fills the 227 KB a CTA may have: 3 stages at D = 128.
  // dQ: Q and dO go to registers at the tile's start, so one resident buffer, given back then
  // (the next tile's pair loads into it during the walk), a staging tile for dQ's store, and
  // 4 stages at D = 128 (8 at D = 64): the dQ pass overlaps a step's accumulation with the next
  // step's products, so it holds two stages at a time, and with 3 stages the copy of a step was
  // issued one step before it was needed (ncu: the dQ kernel 8.20 → 7.86 ms at S = 32768
  // causal; sustained, under the power cap, 0–2 % of forward + backward).
  static constexpr int kResBufs = KV_SIDE ? 2 : 1;
  static constexpr int kStages = KV_SIDE ? (D == 128 ? 3 : 4) : (D == 128 ? 4 : 8);
  static_assert(kStages >= 2, "the consumers hold one stage while waiting for the next");
  static constexpr int kResBytes = kBwdRows * D * 2;   // one resident tile
  static constexpr int kPairBytes = 2 * kResBytes;     // resident buffer r at r·kPairBytes
  static constexpr int kStrBytes = kBwdStep * D * 2;   // one streamed tile
  static constexpr int kOut = kResBufs * kPairBytes;   // dQ's staging tile (kResBytes; none for dK/dV)
  static constexpr int kStage0 = kOut + (KV_SIDE ? 0 : kResBytes);  // stage s: two streamed tiles at kStage0 + 2·s·kStrBytes
  static constexpr int kStats = kStage0 + 2 * kStages * kStrBytes;  // dK/dV: [kStages][2][kBwdStep] f32: exp_base(lse), delta
  static constexpr int kBar = kStats + (KV_SIDE ? kStages * 2 * kBwdStep * 4 : 0);  // res_full[2], res_empty[2], full[S], empty[S]
  // int32 from the producer: [kStages][2] the step of a stage (its first streamed row and (head
  // offset · 2 + partial-pass bit), or kWalkEnd after the tile's last step; published by
  // full[s]), then [2] the tile of a resident buffer (or −1: no more tiles; published by
  // res_full[r]).
  static constexpr int kInfo = kBar + (4 + 2 * kStages) * 8;
  static constexpr int kTileSlot = kInfo + kStages * 2 * 4;
  static constexpr int kBytes = kTileSlot + 2 * 4 + 1024;
  static_assert(kBytes <= 227 * 1024, "a CTA may have 227 KB of shared memory");
};

// The tensor maps of one pass: the resident pair, the streamed pair, and two of 64-row boxes.
struct BwdMaps {
  CUtensorMap r0, r1, s0, s1;
  CUtensorMap o0, o1;  // dK/dV: dK and dV (written); dQ: dQ (written) and O (read for delta)
};

// A tile of a pass: (row tile, b, head) from its linear index, in the order tile_rank gives
// (attention_fwd_wgmma.cuh: heads fastest or head-major). The causal masks make the first KV
// tiles (dK/dV) and the last Q tiles (dQ) the heaviest, so the dQ pass numbers its tiles
// backwards and each (b, head) starts with its heaviest. dK/dV: `head` is the kv head, whose
// walk covers its G query heads; dQ: the q head.
template <bool KV_SIDE> struct BwdTile {
  int b, head;
  int64_t row0;  // first resident row
  __device__ __forceinline__ BwdTile(const FlexParams& p, int32_t t, int64_t n_row_tiles, bool heads_fastest) {
    const uint32_t n_res_heads = static_cast<uint32_t>(KV_SIDE ? p.Hkv : p.Hq);
    const TileRank tr =
        tile_rank(t, static_cast<uint32_t>(n_row_tiles), n_res_heads * static_cast<uint32_t>(p.B), heads_fastest);
    head = static_cast<int>(tr.bh % n_res_heads), b = static_cast<int>(tr.bh / n_res_heads);
    row0 = (KV_SIDE ? tr.rank : n_row_tiles - 1 - tr.rank) * kBwdRows;
  }
};

template <class T, int D, bool KV_SIDE, class SM, class MM>
__global__ void __launch_bounds__(kThreads, 1) flex_bwd_wgmma_kernel(const __grid_constant__ BwdMaps maps, FlexParams p,
                                                                     SM sm, MM mm, bool heads_fastest,
                                                                     int32_t* tile_counter) {
  using Smem = BwdSmem<D, KV_SIDE>;
  constexpr int kStages = Smem::kStages;
  constexpr uint32_t kResBufs = Smem::kResBufs;
  constexpr int kGroups = D / 64;
  constexpr bool kIdentity = dev::is_same_v<SM, attention::NoScoreMod>;
  extern __shared__ unsigned char bwd_wgmma_smem[];
  unsigned char* smem = wg::align_1024(bwd_wgmma_smem);
  // The barriers as 32-bit shared addresses (wgmma.cuh's mbarriers).
  const uint32_t base = wg::smem_u32(smem), bars = base + Smem::kBar;
  auto res_full = [&](uint32_t r) { return bars + 8 * r; };
  auto res_empty = [&](uint32_t r) { return bars + 8 * (2 + r); };
  auto full = [&](uint32_t s) { return bars + 8 * (4 + s); };
  auto empty = [&](uint32_t s) { return bars + 8 * (4 + kStages + s); };
  const float* stats = reinterpret_cast<const float*>(smem + Smem::kStats);
  int32_t* info = reinterpret_cast<int32_t*>(smem + Smem::kInfo);
  int32_t* tile_slot = reinterpret_cast<int32_t*>(smem + Smem::kTileSlot);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // The grid is persistent (at most one CTA per SM): a CTA takes tile blockIdx.x, then claims
  // the next from tile_counter (each tile has one owner, so the results do not depend on who
  // takes it). The tile order is heaviest first (BwdTile).
  const int64_t G = p.Hq / p.Hkv;
  const int64_t n_row_tiles = ((KV_SIDE ? p.S : p.L) + kBwdRows - 1) / kBwdRows;
  const int64_t n_tiles = n_row_tiles * (KV_SIDE ? p.Hkv : p.Hq) * p.B;
  const int64_t limit = KV_SIDE ? p.L : p.S;                 // streamed rows end here
  const int64_t res_len = KV_SIDE ? p.S : p.L;               // resident rows end here

  // dK/dV: the producer warp's 32 lanes also store each step's lse and delta (plain loads: the
  // rows of a (b, h) need not be 16-byte aligned for a copy), so `full` waits for them too.
  constexpr uint32_t kFullArrivals = KV_SIDE ? 1 + 32 : 1;
  // In the other direction every consumer thread arrives on `empty` and `res_empty`: an arrive
  // releases the arriving thread's own accesses, and each lane reads the tile's and the stage's
  // slots and, in dK/dV, its columns' lse and delta before the producer may rewrite them. (One
  // elected lane after __syncwarp is also ordered under PTX's memory model, but
  // compute-sanitizer's racecheck credits a thread only with its own arrive and reported those
  // reads as WAR hazards. Measured on the H200 against one lane per warp: the backward within
  // 1 %, S = 32768 causal 22.25 against 22.40 ms.)
  constexpr uint32_t kConsumerArrivals = kConsumerWarps * 32;
  if (tid == 0) {
    // res_empty: dQ's consumers once they have their resident rows in registers and delta;
    // dK/dV's once they have staged their results there, their issuers once the stores have read them.
    for (int r = 0; r < 2; ++r) wg::mbar_init(res_full(r), 1), wg::mbar_init(res_empty(r), kConsumerArrivals);
    for (int s = 0; s < kStages; ++s) wg::mbar_init(full(s), kFullArrivals), wg::mbar_init(empty(s), kConsumerArrivals);
    wg::mbar_init_fence();
  }
  __syncthreads();

  if (warp >= kConsumerWarps) {
    // ---- producer: lane 0 of its first warp claims the tiles and issues the copies ----
    wg::setmaxnreg_dec<kProducerRegs>();
    if (warp != kConsumerWarps) return;
    uint32_t it = 0;  // stage uses, over all tiles
    for (uint32_t tc = 0;; ++tc) {
      const uint32_t buf = tc % kResBufs, res_phase = (tc / kResBufs) & 1;
      int32_t t = 0;
      if (lane == 0) t = tc == 0 ? static_cast<int32_t>(blockIdx.x) : claim_tile(tile_counter);
      t = __shfl_sync(0xffffffffu, t, 0);
      // Resident buffer `buf` is free once its previous tile is done with it (dK/dV: has stored
      // its results from it; dQ: has its rows in registers).
      wg::mbar_wait(res_empty(buf), res_phase ^ 1);
      if (t >= n_tiles) {
        if (lane == 0) tile_slot[buf] = -1, wg::mbar_arrive(res_full(buf));
        break;
      }
      const BwdTile<KV_SIDE> tile(p, t, n_row_tiles, heads_fastest);
      const int b = tile.b, head = tile.head;
      const int64_t h0 = KV_SIDE ? head * G : head, n_heads = KV_SIDE ? G : 1;
      const int64_t blk = KV_SIDE ? tile.row0 / p.KB : mask_row(p, b, head) * p.nQ + tile.row0 / p.QB;
      if (lane == 0) {
        tile_slot[buf] = t;  // released by the arrive below
        wg::mbar_arrive_expect_tx(res_full(buf), 2 * Smem::kResBytes);
        const uint32_t res = base + buf * Smem::kPairBytes;
        load_rows_tma<kGroups, kBwdRows>(res, &maps.r0, res_full(buf), static_cast<int>(tile.row0), head, b);
        load_rows_tma<kGroups, kBwdRows>(res + Smem::kResBytes, &maps.r1, res_full(buf), static_cast<int>(tile.row0),
                                         head, b);
      }
      if constexpr (!KV_SIDE) {
        // The dQ pass's first stage of a tile holds the tile's 128 rows of O, for delta.
        const uint32_t stage = it % kStages, phase = (it / kStages) & 1;
        ++it;
        wg::mbar_wait(empty(stage), phase ^ 1);
        if (lane == 0) {
          wg::mbar_arrive_expect_tx(full(stage), 2 * Smem::kStrBytes);
          const uint32_t st = base + Smem::kStage0 + stage * 2 * Smem::kStrBytes;
#pragma unroll
          for (int half = 0; half < 2; ++half)  // two 64-row boxes, in the places of the streamed pair
            load_rows_tma<kGroups, kBwdStep>(st + half * Smem::kStrBytes, &maps.o1, full(stage),
                                             static_cast<int>(tile.row0) + 64 * half, head, b);
        }
      }
      // The producer alone walks the block lists: each stage's slot tells the consumers its
      // step, and one more stage with no copy (meta kWalkEnd) tells them the tile's walk is over.
      flex_mma::bwd::Cursor cur;
      flex_mma::bwd::advance<kBwdStep, KV_SIDE>(p, b, h0, n_heads, blk, limit, cur);
      for (;; ++it) {
        const uint32_t stage = it % kStages, phase = (it / kStages) & 1;
        wg::mbar_wait(empty(stage), phase ^ 1);
        int32_t* slot = info + 2 * stage;
        if (!cur.valid) {
          if (lane == 0) slot[1] = kWalkEnd, wg::mbar_arrive(full(stage));
          if constexpr (KV_SIDE) wg::mbar_arrive(full(stage));  // the 32 lanes' arrivals, as for a step
          ++it;
          break;
        }
        const int hs = KV_SIDE ? static_cast<int>(h0 + cur.hi) : static_cast<int>(head / G);
        const int start = static_cast<int>(cur.start);
        if (lane == 0) {
          slot[0] = start, slot[1] = cur.hi * 2 + cur.pass;  // released by the arrive below
          wg::mbar_arrive_expect_tx(full(stage), 2 * Smem::kStrBytes);
          const uint32_t st = base + Smem::kStage0 + stage * 2 * Smem::kStrBytes;
          load_rows_tma<kGroups, kBwdStep>(st, &maps.s0, full(stage), start, hs, b);
          load_rows_tma<kGroups, kBwdStep>(st + Smem::kStrBytes, &maps.s1, full(stage), start, hs, b);
        }
        if constexpr (KV_SIDE) {
          const int64_t o = (static_cast<int64_t>(b) * p.Hq + hs) * p.L;
          float* stat = reinterpret_cast<float*>(smem + Smem::kStats) + stage * 2 * kBwdStep;
#pragma unroll
          for (int x = lane; x < kBwdStep; x += 32) {
            const int64_t i = start + x;
            stat[x] = flex_mma::bwd::exp_base<kIdentity>(i < p.L ? p.lse[o + i] : -INFINITY);
            stat[kBwdStep + x] = i < p.L ? p.delta[o + i] : 0.0f;
          }
          wg::mbar_arrive(full(stage));  // release: the stores above are visible to the waiters
        }
        flex_mma::bwd::advance<kBwdStep, KV_SIDE>(p, b, h0, n_heads, blk, limit, cur);
      }
    }
    return;
  }

  // ---- consumers: warpgroup wgi owns resident rows 64·wgi .. 64·wgi + 63 ----
  wg::setmaxnreg_inc<kConsumerRegs>();
  const int wgi = warp >> 2, wq = warp & 3, g = lane >> 2, t4 = lane & 3;
  const int L = static_cast<int>(p.L);
  const bool issuer = wq == 0 && lane == 0;  // stores this warpgroup's results
  constexpr int kNt = kBwdStep / 8, kAt = D / 8;

  // The tile being walked (set per tile; the lambdas below read it).
  int b = 0, head = 0, wrow = 0;  // wrow: this warp's first resident row
  int64_t row0 = 0, h0 = 0;
  bool res_tail = false;
  uint32_t r0_base = 0, r1_base = 0;  // this warpgroup's rows of the resident pair
  // dQ: exp_base(lse) and delta of this thread's two rows (g, g + 8), fixed for a tile's walk.
  float row_lse[2] = {0.0f, 0.0f}, row_delta[2] = {0.0f, 0.0f};

  // Overlap the accumulating products with the next step's softmax where the registers allow:
  // the identity score_mod's dQ pass, and its dK/dV pass at E = 64. A score mod's element step
  // (grad_elem, branch-free) holds more values at once: next to an accumulation in flight,
  // ptxas serialised the wgmma of every such loop (warning C7511), so score mods take one step
  // after another, and the other warpgroup's products fill the tensor cores meanwhile.
  constexpr bool kOverlap = kIdentity && (!KV_SIDE || D == 64);
  // Without the overlap (dK/dV at E = 128) and with the identity score_mod: dV += Pᵀ·dO runs on
  // the tensor cores while the warpgroup computes dS, which needs no register more (P stays
  // in f32 for dS either way).
  constexpr bool kSplitAcc = KV_SIDE && !kOverlap && kIdentity;
  float acc0[kAt][4], acc1[kAt][4];  // dK/dV: dK, dV; dQ: dQ, unused

  // One step in four parts: issue X = R0·S0ᵀ and dX = R1·S1ᵀ (64 × 64 each, K-major operands);
  // P and dS in place of X and dX; their 16-bit A fragments; the accumulating products with the
  // streamed tiles read transposed (MN-major, 64-row tiles).
  float x[kNt][4], dx[kNt][4];
  uint32_t da[kBwdStep / 16][4], pa[kBwdStep / 16][4];
  // dQ: the warpgroup's resident rows (Q, dO) as A fragments in registers, read once a tile, so
  // that S = Q·Kᵀ and dP = dO·Vᵀ read only K and V from shared memory (with both operands there
  // an m64n64k16 step reads 4 KB, as much as shared memory delivers in the step's tensor time).
  // dK/dV keeps K and V in shared memory: next to its two accumulators even K alone spilled
  // 64 bytes at E = 128 and ran the pass 30 % slower; 4 or 5 of K's 8 k16 chunks fit, and gained
  // nothing measurable (BENCHMARKS.md, 2026-12-01 19:20). (A score mod's dQ pass at E = 128 spilled
  // 176 bytes with softcap when its element step branched per element and overlapped; one step
  // at a time with the branch-free step, it spills nothing.)
  constexpr bool kResInRegs = !KV_SIDE;
  uint32_t ra0[kResInRegs ? D / 16 : 1][4], ra1[kResInRegs ? D / 16 : 1][4];
  auto load_resident_fragments = [&] {
    const mma::ALaneAddr at = mma::a_fragment_lane(lane);  // within the warp's 16 rows and a k16 chunk
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = wg::sw128_offset<kBwdRows>(16 * wq + at.row, 16 * kk + at.col);
      mma::ldmatrix_x4(ra0[kk], r0_base + off);
      mma::ldmatrix_x4(ra1[kk], r1_base + off);
    }
  };
  auto stage_base = [&](uint32_t stage) { return base + Smem::kStage0 + stage * 2 * Smem::kStrBytes; };
  auto issue_products = [&](uint32_t s0_base) {
    const uint64_t s0 = wg::desc_sw128(s0_base, 16, 1024), s1 = wg::desc_sw128(s0_base + Smem::kStrBytes, 16, 1024);
    const uint64_t r0 = wg::desc_sw128(r0_base, 16, 1024), r1 = wg::desc_sw128(r1_base, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk >> 2) * kBwdRows * 128 + (kk & 3) * 32;
      const uint32_t soff = (kk >> 2) * kBwdStep * 128 + (kk & 3) * 32;
      if constexpr (kResInRegs) {
        wg::wgmma_rs<T, kBwdStep, 0>(x, ra0[kk], wg::desc_advance(s0, soff), kk > 0 ? 1 : 0);
        wg::wgmma_rs<T, kBwdStep, 0>(dx, ra1[kk], wg::desc_advance(s1, soff), kk > 0 ? 1 : 0);
      } else {
        wg::wgmma_ss<T, kBwdStep>(x, wg::desc_advance(r0, off), wg::desc_advance(s0, soff), kk > 0 ? 1 : 0);
        wg::wgmma_ss<T, kBwdStep>(dx, wg::desc_advance(r1, off), wg::desc_advance(s1, soff), kk > 0 ? 1 : 0);
      }
    }
  };
  // Rows of the fragments are resident rows, columns streamed ones. `part`: PAndDs, or (the
  // identity score_mod, kSplitAcc below) POnly, then DsOnly from that P.
  using PAndDs = dev::integral_constant<int, 0>;
  using POnly = dev::integral_constant<int, 1>;
  using DsOnly = dev::integral_constant<int, 2>;
  auto gradients = [&](const flex_mma::bwd::Cursor& c, uint32_t stage, auto part) {
    constexpr bool kP = !dev::is_same_v<decltype(part), DsOnly>, kDs = !dev::is_same_v<decltype(part), POnly>;
    const int h = KV_SIDE ? static_cast<int>(h0 + c.hi) : head;  // the query head of this step
    const int start = static_cast<int>(c.start);
    const bool partial = c.pass == 0;
    const bool bounds = res_tail || c.start + kBwdStep > limit;
    const float* st_lse = stats + stage * 2 * kBwdStep;
    [[maybe_unused]] const float* st_delta = st_lse + kBwdStep;  // unused by some score mods
    // Which elements count: all of a full in-range tile.
    const bool full_tile = !(partial || bounds);  // the same for the whole CTA
    uint32_t kept = 0xffffffffu;
    if constexpr (kP)
      if (!full_tile)
        kept = flex_mma::bwd::kept_bits<kBwdStep, !KV_SIDE, kIdentity>(p, mm, partial, bounds, b, h, wrow, start, lane);
    if constexpr (kIdentity) {
      // The identity score_mod: P = 2^(S·scale·log2 e − base) with base = lse·log2 e from the
      // stats (+inf for a row that kept nothing: P = 0); dS without its factor scale, which
      // multiplies the accumulator once at the end. The mask and bounds, where a tile needs
      // them, only select.
      const float mul = p.scale * kLog2e;
      auto elements = [&]<bool kMasked>() {
#pragma unroll
        for (int j = 0; j < kNt; ++j) {
          // dK/dV: the stats of this thread's two columns 8j + 2·t4 (+1), one 8-byte load each.
          [[maybe_unused]] float2 col_base{}, col_delta{};  // one of them unused in POnly, DsOnly
          if constexpr (KV_SIDE && kP) col_base = *reinterpret_cast<const float2*>(st_lse + 8 * j + 2 * t4);
          if constexpr (KV_SIDE && kDs) col_delta = *reinterpret_cast<const float2*>(st_delta + 8 * j + 2 * t4);
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if constexpr (kP) {
              const float base = KV_SIDE ? (r & 1 ? col_base.y : col_base.x) : row_lse[r >> 1];
              float pv = fast_exp2(fmaf(x[j][r], mul, -base));
              if constexpr (kMasked) pv = (kept >> (j * 4 + r)) & 1u ? pv : 0.0f;
              x[j][r] = pv;
            }
            if constexpr (kDs) {
              const float delta = KV_SIDE ? (r & 1 ? col_delta.y : col_delta.x) : row_delta[r >> 1];
              dx[j][r] = x[j][r] * (dx[j][r] - delta);
            }
          }
        }
      };
      if (!kP || full_tile)
        elements.template operator()<false>();
      else
        elements.template operator()<true>();
    } else {
      static_assert(kP && kDs, "a score mod's element step computes P and dS together");
      // Full in-range tiles (most of a causal walk) skip the kept bits and the index clamps;
      // dK/dV reads its two columns' stats with one 8-byte load each, as the identity step.
      auto elements = [&]<bool kMasked>() {
#pragma unroll
        for (int j = 0; j < kNt; ++j) {
          [[maybe_unused]] float2 col_lse{}, col_delta{};
          if constexpr (KV_SIDE) {
            col_lse = *reinterpret_cast<const float2*>(st_lse + 8 * j + 2 * t4);
            col_delta = *reinterpret_cast<const float2*>(st_delta + 8 * j + 2 * t4);
          }
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int col = 8 * j + 2 * t4 + (r & 1), row = wrow + g + 8 * (r >> 1);
            const int i = KV_SIDE ? start + col : row, jj = KV_SIDE ? row : start + col;
            const float lse = KV_SIDE ? (r & 1 ? col_lse.y : col_lse.x) : row_lse[r >> 1];
            const float delta = KV_SIDE ? (r & 1 ? col_delta.y : col_delta.x) : row_delta[r >> 1];
            flex_mma::bwd::grad_elem<SM, kMasked>(p, sm, (kept >> (j * 4 + r)) & 1u, b, h, i, jj, x[j][r], dx[j][r],
                                                  lse, delta);
          }
        }
      };
      if (full_tile)
        elements.template operator()<false>();
      else
        elements.template operator()<true>();
    }
  };
  auto pack_ds = [&] {
#pragma unroll
    for (int kk = 0; kk < kBwdStep / 16; ++kk) c_to_a<T>(da[kk], dx[2 * kk], dx[2 * kk + 1]);
  };
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kBwdStep / 16; ++kk) c_to_a<T>(pa[kk], x[2 * kk], x[2 * kk + 1]);
  };
  auto pack = [&] {
    pack_ds();
    if constexpr (KV_SIDE) pack_p();
  };
  // dK += dSᵀ·Q (S0 = Q) or dQ += dS·K (S0 = K) with kDs; dV += Pᵀ·dO (S1 = dO) with kP.
  auto issue_accumulate = [&]<bool kDs = true, bool kP = KV_SIDE>(uint32_t s0_base) {
    const uint64_t s0 = wg::desc_sw128(s0_base, kBwdStep * 128, 1024);
    const uint64_t s1 = wg::desc_sw128(s0_base + Smem::kStrBytes, kBwdStep * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBwdStep / 16; ++kk) {
      if constexpr (kDs) wg::wgmma_rs<T, D, 1>(acc0, da[kk], wg::desc_advance(s0, kk * 16 * 128), 1);
      if constexpr (kP) wg::wgmma_rs<T, D, 1>(acc1, pa[kk], wg::desc_advance(s1, kk * 16 * 128), 1);
    }
  };
  auto fence_all = [&] {
    wg::fence_operands(x);
    wg::fence_operands(dx);
    wg::fence_operands(acc0);
    wg::fence_operands(acc1);
    wg::fence_operands(da);
    wg::fence_operands(pa);
    if constexpr (kResInRegs) wg::fence_operands(ra0), wg::fence_operands(ra1);
  };

  // `issue` (this warpgroup's wgmma) issued and waited for, fenced on every register operand;
  // the products of a stage that way; the accumulation of a stage that way, then the stage
  // released.
  auto issue_and_wait = [&](auto issue) {
    fence_all();
    wg::fence();
    issue();
    wg::commit();
    wg::wait<0>();
    fence_all();
  };
  // kSplitAcc: one of the step's accumulating products issued and committed, its operand and
  // accumulator fenced: dK += dSᵀ·Q (kDs) or dV += Pᵀ·dO.
  auto issue_one_accumulate = [&]<bool kDs>(uint32_t stage) {
    if constexpr (kDs)
      wg::fence_operands(da), wg::fence_operands(acc0);
    else
      wg::fence_operands(pa), wg::fence_operands(acc1);
    wg::fence();
    issue_accumulate.template operator()<kDs, !kDs>(stage_base(stage));
    wg::commit();
  };
  auto products_now = [&](uint32_t stage) { issue_and_wait([&] { issue_products(stage_base(stage)); }); };
  auto accumulate_now = [&](uint32_t stage) {
    issue_and_wait([&] { issue_accumulate(stage_base(stage)); });
    wg::mbar_arrive(empty(stage));
  };

  // The step of a stage from the producer's slot (read after full[stage]); false: the tile's
  // walk is over (the stage is then released at once: it holds no copy).
  auto read_step = [&](uint32_t stage, flex_mma::bwd::Cursor& c) {
    const int32_t meta = info[2 * stage + 1];
    if (meta == kWalkEnd) {
      wg::mbar_arrive(empty(stage));
      return false;
    }
    c.start = info[2 * stage], c.hi = meta >> 1, c.pass = meta & 1;
    return true;
  };
  // The previous tile's results have been read out of its resident buffer (the store was issued
  // a step ago): the producer may load a later tile's pair there.
  bool prev_pending = false;
  auto release_previous = [&](uint32_t buf) {
    if (!prev_pending) return;
    prev_pending = false;
    if (issuer) wg::bulk_wait_read<0>(), wg::mbar_arrive(res_empty(buf ^ 1));
  };
  uint32_t it = 0;  // stage uses, over all tiles (as the producer counts them)
  for (uint32_t tc = 0;; ++tc) {
    const uint32_t buf = tc % kResBufs;
    wg::mbar_wait(res_full(buf), (tc / kResBufs) & 1);
    const int32_t t = tile_slot[buf];
    if (t < 0) break;
    {
      const BwdTile<KV_SIDE> tile(p, t, n_row_tiles, heads_fastest);
      b = tile.b, head = tile.head, row0 = tile.row0;
    }
    h0 = KV_SIDE ? head * G : head;
    wrow = static_cast<int>(row0) + 64 * wgi + 16 * wq;
    res_tail = row0 + kBwdRows > res_len;
    r0_base = base + buf * Smem::kPairBytes + wgi * 64 * 128;
    r1_base = r0_base + Smem::kResBytes;
    if constexpr (kResInRegs) load_resident_fragments();
    if constexpr (!KV_SIDE) {
      const int64_t o = (static_cast<int64_t>(b) * p.Hq + head) * p.L;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = wrow + g + 8 * r;
        row_lse[r] = flex_mma::bwd::exp_base<kIdentity>(i < L ? p.lse[o + i] : -INFINITY);
      }
      // delta = rowsum(dO ∘ O) − dlse of the warp's 16 rows, from dO (resident) and O (the
      // tile's first stage): two lanes a row, D / 2 columns each, in 16-byte chunks; written
      // for the dK/dV pass, which runs after this one.
      const uint32_t stage = it % kStages;
      wg::mbar_wait(full(stage), (it / kStages) & 1);
      const int rr = lane >> 1, half = lane & 1, lr = 16 * wq + rr;  // lr: row within the warpgroup's 64
      const unsigned char* o_rows = smem + Smem::kStage0 + stage * 2 * Smem::kStrBytes + wgi * Smem::kStrBytes;
      const unsigned char* do_rows = smem + buf * Smem::kPairBytes + Smem::kResBytes + wgi * 64 * 128;
      float d = 0.0f;
#pragma unroll
      for (int c = half * D / 16; c < (half + 1) * D / 16; ++c)  // c: a 16-byte chunk of the row
        flex_mma::bwd::accumulate_dot8<T>(
            d, *reinterpret_cast<const uint4*>(o_rows + wg::sw128_offset<kBwdStep>(lr, 8 * c)),
            *reinterpret_cast<const uint4*>(do_rows + wg::sw128_offset<kBwdRows>(lr, 8 * c)));
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      const int i = wrow + rr;
      if (i < L) {
        if (p.dlse) d -= p.dlse[o + i];
        if (half == 0) p.delta[o + i] = d;
      }
      // The warp has read its O rows and (here and by ldmatrix, above) its resident rows: the
      // stage goes back, and so does the resident buffer once all 8 warps are here (the next
      // tile's Q and dO load into it during this walk).
      wg::mbar_arrive(empty(stage)), wg::mbar_arrive(res_empty(buf));
      ++it;
#pragma unroll
      for (int r = 0; r < 2; ++r) row_delta[r] = __shfl_sync(0xffffffffu, d, 2 * (g + 8 * r));
    }
#pragma unroll
    for (int j = 0; j < kAt; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc0[j][r] = acc1[j][r] = 0.0f;

    flex_mma::bwd::Cursor cur;
    if constexpr (!kOverlap) {
      // One step after another (kOverlap above: the identity's dK/dV pass at E = 128, whose 128
      // accumulator registers leave no room for a second step's S and dP, and every score mod).
      for (;; ++it) {
        const uint32_t stage = it % kStages;
        wg::mbar_wait(full(stage), (it / kStages) & 1);
        if (!read_step(stage, cur)) break;
        products_now(stage);
        release_previous(buf);
        if constexpr (kSplitAcc) {
          gradients(cur, stage, POnly{});
          pack_p();
          issue_one_accumulate.template operator()<false>(stage);  // dV += Pᵀ·dO
          gradients(cur, stage, DsOnly{});  // while it runs
          pack_ds();
          issue_one_accumulate.template operator()<true>(stage);  // dK += dSᵀ·Q
          wg::wait<0>();
          fence_all();
          wg::mbar_arrive(empty(stage));
        } else {
          gradients(cur, stage, PAndDs{});
          pack();
          accumulate_now(stage);
        }
      }
      ++it;  // the end stage
    } else {
      uint32_t stage = it % kStages;
      wg::mbar_wait(full(stage), (it / kStages) & 1);
      if (read_step(stage, cur)) {
        // Step 0 (nothing to overlap with yet).
        uint32_t prev = stage;
        products_now(prev);
        release_previous(buf);
        gradients(cur, prev, PAndDs{});
        pack();
        // Steps 1 ..: the previous step's accumulating products run on the tensor cores while
        // this warpgroup computes P and dS of the current step.
        for (++it;; ++it) {
          stage = it % kStages;
          wg::mbar_wait(full(stage), (it / kStages) & 1);
          if (!read_step(stage, cur)) break;
          fence_all();
          wg::fence();
          issue_products(stage_base(stage));
          wg::commit();
          issue_accumulate(stage_base(prev));
          wg::commit();
          wg::wait<1>();          // the products landed; the accumulation may still run
          wg::fence_operands(x);  // only these: the accumulators may still be in flight
          wg::fence_operands(dx);
          gradients(cur, stage, PAndDs{});
          wg::wait<0>();
          fence_all();
          wg::mbar_arrive(empty(prev));
          pack();
          prev = stage;
        }
        accumulate_now(prev);  // the last step's
      }
      ++it;  // the end stage
    }
    release_previous(buf);  // a tile with no steps

    // The identity path left the factor scale out of dS: dK (or dQ) takes it once here.
    if constexpr (kIdentity) {
#pragma unroll
      for (int j = 0; j < kAt; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc0[j][r] *= p.scale;
    }
    if constexpr (KV_SIDE) {
      // The warpgroup's products no longer read its resident rows: they take its results on the
      // way to a TMA store (rows past the resident length are not written). The buffer is
      // released once the stores have read them: every thread but the issuers arrives now, the
      // issuers after their stores (release_previous, during the next tile).
      unsigned char* res = smem + buf * Smem::kPairBytes;
      wg::store_rows_tma<T, kAt, kBwdRows>(acc0, res, wgi, lane, issuer, &maps.o0, static_cast<int>(row0), head, b);
      wg::store_rows_tma<T, kAt, kBwdRows>(acc1, res + Smem::kResBytes, wgi, lane, issuer, &maps.o1, static_cast<int>(row0),
                                       head, b);
      if (!issuer) wg::mbar_arrive(res_empty(buf));
      prev_pending = true;
    } else {
      // dQ through the staging tile, once the previous tile's store has read it (a walk ago).
      if (issuer) wg::bulk_wait_read<0>();
      wg::named_barrier(1 + wgi, 128);
      wg::store_rows_tma<T, kAt, kBwdRows>(acc0, smem + Smem::kOut, wgi, lane, issuer, &maps.o0, static_cast<int>(row0), head,
                                       b);
    }
  }
  if (issuer) wg::bulk_wait_read<0>();  // the last stores read shared memory before the CTA ends
}

}  // namespace kiln::kernels::cuda::flex_wgmma
