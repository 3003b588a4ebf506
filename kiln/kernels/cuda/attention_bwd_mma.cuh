// The tensor-core (mma.sync m16n8k16) FlexAttention backward for 16-bit q/k/v, head dims 64, 128
// and 256 (two CTAs of 128 columns each per tile, see launch below), bitwise deterministic:
// flex_backward_mma() launches
//   1. delta = rowsum(dO ∘ O) − dlse (16-byte vector loads, a fixed shuffle tree per row);
//   2. the dK/dV kernel: a CTA (4 warps × 16 keys) owns 64 keys of one (b, kv head); for each
//      query head of the GQA group it walks the q_blocks lists of its KV block (partial tiles
//      with the mask, then full ones) in a fixed order, 64 (E=64), 32 (E=128) or 16 (E=256)
//      queries per step, computing Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (rows = keys) so Pᵀ = exp(Sᵀ − lse) and
//      dSᵀ = Pᵀ ∘ (dPᵀ − delta) · dscore · scale are A fragments in registers:
//      dV += Pᵀ·dO, dK += dSᵀ·Q, accumulated in f32 registers and written once;
//   3. the dQ kernel: a CTA owns 64·MT queries of one (b, q head), MT m16 tiles per warp (MT = 2,
//      32-key steps at E = 64 with q blocks multiples of 128: every K/V fragment read from
//      shared memory feeds two mma; else MT = 1, 64-key steps, 16 at E = 256), and walks the
//      kv_blocks lists of its Q block in order: S = Q·Kᵀ, dP = dO·Vᵀ, dS, dQ += dS·K, written once.
// Both kernels are templates on MT; registers decide (dK/dV with MT = 2 spills: its dK and dV
// accumulators double). One __syncthreads per step: wait for the step's tiles, sync (which
// also proves the other buffer is free), then issue the next step's tiles and compute.
// Every output element has exactly one owner thread that reduces in a fixed order (no atomics),
// so gradients are identical run to run. S and dP are computed twice (once per kernel): the
// price of determinism without atomics (see docs/attention.md, "CUDA backward").
// Q/dO (dK/dV kernel) and K/V (dQ kernel) tiles are double-buffered with cp.async into
// swizzled shared tiles; the resident tile is loaded once. Tails are zero-filled and masked by
// bounds; fully masked rows (lse = −inf) contribute nothing.
// flex_mma::flex_backward_mma() returns false when it does not apply (f32, other head dims, E != Ev,
// block sizes not multiples of the tiles, learnable score mods, unaligned pointers or strides):
// the caller then runs the SIMT kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kiln/kernels/device_std.h"
#include "kiln/kernels/flex_mods.h"
#include "kiln/kernels/cuda/attention_mma_common.cuh"

namespace kiln::kernels::cuda::flex_mma {
namespace bwd {

constexpr int kTile = 64;  // the smallest CTA tile: 4 warps × 16 rows (blocks must be multiples)
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// One step of a block-list walk: (head offset in the group, partial?, list position, sub-tile).
struct Cursor {
  int hi = 0, pass = 0, c = 0, sub = -1;
  int64_t start = 0;  // first row (query for dK/dV, key for dQ) of the step's tile
  bool valid = true;
};

// Advances to the next step of the walk over G heads (dK/dV: the q_blocks of KV block `blk`;
// dQ: G = 1 and the kv_blocks of mask row `blk`), skipping sub-tiles past `limit`.
template <int STEP, bool KV_SIDE>
__device__ __forceinline__ void advance(const FlexParams& p, int64_t b, int64_t h0, int64_t G, int64_t blk,
                                        int64_t limit, Cursor& s) {
  const int64_t block = KV_SIDE ? p.QB : p.KB;
  const int nsub = static_cast<int>(block / STEP);
  while (true) {
    if (++s.sub >= nsub) s.sub = 0, ++s.c;
    while (true) {
      if (s.hi >= G) {
        s.valid = false;
        return;
      }
      FlexParams::BlockList lst;
      if constexpr (KV_SIDE)
        lst = p.q_blocks(mask_row(p, b, h0 + s.hi) * p.nKV + blk, s.pass == 0);
      else
        lst = p.kv_blocks(blk, s.pass == 0);
      if (s.c < lst.count) {
        s.start = static_cast<int64_t>(lst.index[s.c]) * block + static_cast<int64_t>(s.sub) * STEP;
        break;
      }
      s.c = 0, s.sub = 0;
      if (++s.pass == 2) s.pass = 0, ++s.hi;
    }
    if (s.start < limit) return;
  }
}

// What the backward keeps of a row's lse: with the identity score_mod (the Hopper backward's
// own element step) the exponent base lse·log2 e, else lse itself; +inf for a row that kept
// nothing either way, so that its P = exp(x − base) is 0 with no test.
template <bool kIdentity> __device__ __forceinline__ float exp_base(float lse) {
  if (lse == -INFINITY) return INFINITY;
  return kIdentity ? lse * kLog2e : lse;
}

// Which elements of a warp's 16 × N fragment block are kept (in bounds and, where `partial`,
// mask_mod true; kept_pair): bit 4·nf + r for c[nf][r]. ROWS_ARE_Q: rows are queries (S), else
// keys (Sᵀ). N ≤ 64, so one 32-bit word holds the warp-lane's N / 2 elements. kPerCase: the
// element code compiled once per (mask, bounds) case (bounds checked only where `bounds`):
// faster where masked tiles are many (the identity score_mod's lean step: window and document
// masks 2–4 % faster on the H200), but beside the generic step's mods the copies spilled
// (38–50 bytes with softcap); else one code path with the bounds always checked.
template <int N, bool ROWS_ARE_Q, bool kPerCase = false, class MM>
__device__ __forceinline__ uint32_t kept_bits(const FlexParams& p, const MM& mm, bool partial, bool bounds, int b,
                                              int h, int row0, int col0, int lane) {
  static_assert(N / 2 <= 32, "one bit per fragment element");
  const int g = lane >> 2, t = lane & 3, L = static_cast<int>(p.L), S = static_cast<int>(p.S);
  uint32_t bits = 0;
  auto each = [&]<bool kMask, bool kBounds>() {
#pragma unroll
    for (int nf = 0; nf < N / 8; ++nf)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = row0 + g + (r >> 1) * 8, col = col0 + nf * 8 + 2 * t + (r & 1);
        int i = ROWS_ARE_Q ? row : col, j = ROWS_ARE_Q ? col : row;
        bool keep = kept_pair<kMask, kBounds>(mm, b, h, i, j, L, S);
        if (!kPerCase && partial) keep = keep & mm(b, h, i, j);
        bits |= static_cast<uint32_t>(keep) << (nf * 4 + r);
      }
  };
  if constexpr (kPerCase)
    with_mask_flags(partial, bounds, each);
  else
    each.template operator()<false, true>();
  return bits;
}

// P and dS of one score element from its raw dot products (in place), `base` = exp_base<false>
// of its row's lse; 0 when not kept, when the row kept nothing (base = +inf) or when the
// score_mod gave −inf (P = 0: dS is then 0 whatever dscore says). Branch-free, as the
// forward's apply_mods: the mod and its derivative are evaluated for every element (at indices
// clamped into range, NOTE [flex mods]) and the results selected, so that a thread's elements
// issue together and a table read of the mod (ALiBi's slope) is loaded once a step, not once
// per element behind a branch (H200, S = 8192 causal, ALiBi forward + backward 4.41 → 3.39 ms
// with the Hopper backward's one-step loops for score mods, attention_bwd_wgmma.cuh).
// kMasked = false: a full in-range tile (kept true, indices in range: no clamp).
template <class SM, bool kMasked = true>
__device__ __forceinline__ void grad_elem(const FlexParams& p, const SM& sm, bool kept, int b, int h, int i, int j,
                                          float& s_to_p, float& dp_to_ds, float base, float delta) {
  if constexpr (kMasked) {
    i = min(i, static_cast<int>(p.L) - 1);
    j = min(j, static_cast<int>(p.S) - 1);
  } else {
    kept = true;
  }
  const float raw = __fmul_rn(s_to_p, p.scale);  // rounded alone, as apply_mods' (attention_mma_common.cuh)
  const float x = sm(raw, b, h, i, j);
  const float dscore = sm.dscore(raw, b, h, i, j);
  const float pv = kept ? __expf(x - base) : 0.0f;
  s_to_p = pv;
  dp_to_ds = pv != 0.0f ? pv * (dp_to_ds - delta) * dscore * p.scale : 0.0f;
}

// acc[16·MT rows × N] += A[16·MT × K] · Tile[K][col0 .. col0 + N) where A is given as f32 C
// fragments c[MT][K/8][4] (converted to 16-bit A fragments in registers) and the tile [k][LD] is
// swizzled in shared memory; each B fragment read from shared memory feeds MT mma.
template <class NT, int K, int N, int MT, int LD = N>
__device__ __forceinline__ void acc_c_times_tile(float (&acc)[MT][N / 8][4], const float (&c)[MT][K / 8][4],
                                                 const NT* tile, int lane, int col0 = 0) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) c_to_a<NT>(a[mt], c[mt][2 * kk], c[mt][2 * kk + 1]);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t bb[2][2];
      ldmatrix_b_trans<LD>(bb, tile, kk * 16, col0 + np * 16, lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<NT>(acc[mt][2 * np], a[mt], bb[0]);
        mma_16816<NT>(acc[mt][2 * np + 1], a[mt], bb[1]);
      }
    }
  }
}

// c[16·MT × N] = A · Bᵀ: A = rows row0.. of swizzled [*, E] tile `a_tile`, B = swizzled [N][E]
// tile. The k16 loop is not unrolled (it only moves ldmatrix addresses; unrolled, ptxas hoists
// the loads of every step and runs out of registers).
template <class NT, int E, int N, int MT>
__device__ __forceinline__ void rows_times_tile_t(float (&c)[MT][N / 8][4], const NT* a_tile, int row0,
                                                  const NT* b_tile, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nf = 0; nf < N / 8; ++nf) c[mt][nf][0] = c[mt][nf][1] = c[mt][nf][2] = c[mt][nf][3] = 0.0f;
#pragma unroll 1
  for (int kk = 0; kk < E / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldmatrix_a<E>(a[mt], a_tile, row0 + 16 * mt, kk * 16, lane);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t bb[2][2];
      ldmatrix_b<E>(bb, b_tile, np * 16, kk * 16, lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<NT>(c[mt][2 * np], a[mt], bb[0]);
        mma_16816<NT>(c[mt][2 * np + 1], a[mt], bb[1]);
      }
    }
  }
}

// Writes a warp's 16·MT × N f32 accumulators (rows row0 ..) as 16-bit values in columns
// col0 .. col0 + N of rows of length LD.
template <class NT, int N, int MT, int LD = N>
__device__ __forceinline__ void store_rows(const float (&acc)[MT][N / 8][4], NT* out, int64_t row0, int64_t nrows,
                                           int lane, int col0 = 0) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nf = 0; nf < N / 8; ++nf) store_c<NT>(out, LD, acc[mt][nf], row0 + 16 * mt, col0 + nf * 8, nrows, lane);
}

// d += the dot product of 8 16-bit values with 8 others (16 bytes each), in f32, in element
// order: one step of delta = rowsum(dO ∘ O) (this kernel and the Hopper dQ pass).
template <class NT> __device__ __forceinline__ void accumulate_dot8(float& d, uint4 x, uint4 y) {
  const uint32_t xv[4] = {x.x, x.y, x.z, x.w}, yv[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 a = unpack2<NT>(xv[k]), c = unpack2<NT>(yv[k]);
    d += a.x * c.x + a.y * c.y;
  }
}

template <class NT, int EV>
__global__ void __launch_bounds__(256) delta_kernel(FlexParams p) {
  constexpr int kPerRow = EV / 8;  // threads per row, 8 elements (16 bytes) each
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = tid / kPerRow, rows = p.B * p.Hq * p.L;
  const int part = static_cast<int>(tid % kPerRow);
  float d = 0.0f;
  if (r < rows) {
    accumulate_dot8<NT>(d, *reinterpret_cast<const uint4*>(static_cast<const NT*>(p.out) + r * EV + part * 8),
                        *reinterpret_cast<const uint4*>(static_cast<const NT*>(p.dout) + r * EV + part * 8));
  }
#pragma unroll
  for (int off = kPerRow / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
  if (r < rows && part == 0) p.delta[r] = d - (p.dlse ? p.dlse[r] : 0.0f);
}

// dK/dV: grid (ceil(S / (64·MT)) · E / EC, Hkv, B); warp w owns keys 16·MT·w ..; BQ queries per
// step. A CTA writes EC of the E columns of dK and dV (EC < E: the key tile's CTAs split the
// columns, each computing the tile's Sᵀ and dPᵀ over all of E).
template <class NT, int E, int BQ, int MT, class SM, class MM, int EC = E>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(FlexParams p, SM sm, MM mm) {
  constexpr int kRows = 16 * MT * kWarps;  // keys per CTA
  constexpr int kParts = E / EC;
  static_assert(E % EC == 0 && EC % 16 == 0, "column parts of 16-column multiples");
  extern __shared__ __align__(128) unsigned char kiln_flex_bwd_smem[];
  NT* smem = reinterpret_cast<NT*>(kiln_flex_bwd_smem);
  NT* Ks = smem;
  NT* Vs = Ks + kRows * E;
  NT* Qs = Vs + kRows * E;                                  // [2][BQ][E]
  NT* Gs = Qs + 2 * BQ * E;                                 // dO, [2][BQ][E]
  float* stat = reinterpret_cast<float*>(Gs + 2 * BQ * E);  // [2][2][BQ]: lse, delta
  const int64_t j0 = static_cast<int64_t>(blockIdx.x / kParts) * kRows, hk = blockIdx.y, b = blockIdx.z;
  const int col0 = static_cast<int>(blockIdx.x % kParts) * EC;
  const int64_t G = p.Hq / p.Hkv, kb = j0 / p.KB;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int wrow = 16 * MT * w;

  load_tile_async<kRows, E, kThreads>(Ks, static_cast<const NT*>(p.k) + b * p.k_st[0] + hk * p.k_st[1], p.k_st[2], j0,
                                      p.S, tid);
  load_tile_async<kRows, E, kThreads>(Vs, static_cast<const NT*>(p.v) + b * p.v_st[0] + hk * p.v_st[1], p.v_st[2], j0,
                                      p.S, tid);

  auto issue = [&](const Cursor& c, int buf) {
    const int64_t h = hk * G + c.hi, row = (b * p.Hq + h) * p.L;
    load_tile_async<BQ, E, kThreads>(Qs + buf * BQ * E, static_cast<const NT*>(p.q) + b * p.q_st[0] + h * p.q_st[1],
                                     p.q_st[2], c.start, p.L, tid);
    load_tile_async<BQ, E, kThreads>(Gs + buf * BQ * E, static_cast<const NT*>(p.dout) + row * E, E, c.start, p.L, tid);
    for (int x = tid; x < BQ; x += kThreads) {
      const int64_t i = c.start + x;
      stat[(buf * 2) * BQ + x] = exp_base<false>(i < p.L ? p.lse[row + i] : -INFINITY);
      stat[(buf * 2 + 1) * BQ + x] = i < p.L ? p.delta[row + i] : 0.0f;
    }
  };

  Cursor cur;
  advance<BQ, true>(p, b, hk * G, G, kb, p.L, cur);
  if (cur.valid) issue(cur, 0);
  cp_async_commit();  // K, V and the first Q/dO tile: one group

  float dk[MT][EC / 8][4], dv[MT][EC / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nf = 0; nf < EC / 8; ++nf)
#pragma unroll
      for (int r = 0; r < 4; ++r) dk[mt][nf][r] = dv[mt][nf][r] = 0.0f;

  for (int step = 0; cur.valid; ++step) {
    Cursor nxt = cur;
    advance<BQ, true>(p, b, hk * G, G, kb, p.L, nxt);
    const int buf = step & 1;
    cp_async_wait<0>();  // this step's tiles landed (this thread's copies) ...
    __syncthreads();     // ... everyone's; and every warp is done with buffer buf ^ 1 (previous step)
    if (nxt.valid) {
      issue(nxt, buf ^ 1);
      cp_async_commit();
    }

    const NT* Qb = Qs + buf * BQ * E;
    const NT* Gb = Gs + buf * BQ * E;
    const float* lse_s = stat + (buf * 2) * BQ;
    const float* del_s = stat + (buf * 2 + 1) * BQ;
    const int h = static_cast<int>(hk * G + cur.hi);
    uint32_t kept[MT];
    bool any = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      kept[mt] =
          kept_bits<BQ, false>(p, mm, cur.pass == 0, true, int(b), h, int(j0) + wrow + 16 * mt, int(cur.start), lane);
      any = any || kept[mt] != 0;
    }
    // A warp whose 16·MT × BQ block is entirely masked skips the step: its terms are exactly 0.
    if (__any_sync(0xffffffffu, any)) {
      float s[MT][BQ / 8][4], dp[MT][BQ / 8][4];
      rows_times_tile_t<NT, E, BQ, MT>(s, Ks, wrow, Qb, lane);   // Sᵀ = K·Qᵀ
      rows_times_tile_t<NT, E, BQ, MT>(dp, Vs, wrow, Gb, lane);  // dPᵀ = V·dOᵀ
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nf = 0; nf < BQ / 8; ++nf)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int col = nf * 8 + 2 * t + (r & 1);
            const int i = int(cur.start) + col, j = int(j0) + wrow + 16 * mt + g + (r >> 1) * 8;
            grad_elem(p, sm, (kept[mt] >> (nf * 4 + r)) & 1u, int(b), h, i, j, s[mt][nf][r], dp[mt][nf][r],
                      lse_s[col], del_s[col]);
          }
      acc_c_times_tile<NT, BQ, EC, MT, E>(dv, s, Gb, lane, col0);   // dV += Pᵀ·dO
      acc_c_times_tile<NT, BQ, EC, MT, E>(dk, dp, Qb, lane, col0);  // dK += dSᵀ·Q
    }
    cur = nxt;
  }
  cp_async_wait<0>();

  const int64_t o = (b * p.Hkv + hk) * p.S;
  store_rows<NT, EC, MT, E>(dk, static_cast<NT*>(p.dk) + o * E, j0 + wrow, p.S, lane, col0);
  store_rows<NT, EC, MT, E>(dv, static_cast<NT*>(p.dv) + o * E, j0 + wrow, p.S, lane, col0);
}

// dQ: grid (ceil(L / (64·MT)) · E / EC, Hq, B); warp w owns queries 16·MT·w ..; BK keys per
// step; a CTA writes EC of dQ's E columns (as dK/dV's).
template <class NT, int E, int BK, int MT, class SM, class MM, int EC = E>
__global__ void __launch_bounds__(kThreads) dq_kernel(FlexParams p, SM sm, MM mm) {
  constexpr int kRows = 16 * MT * kWarps;  // queries per CTA
  constexpr int kParts = E / EC;
  static_assert(E % EC == 0 && EC % 16 == 0, "column parts of 16-column multiples");
  extern __shared__ __align__(128) unsigned char kiln_flex_bwd_smem[];
  NT* smem = reinterpret_cast<NT*>(kiln_flex_bwd_smem);
  NT* Qs = smem;
  NT* Gs = Qs + kRows * E;
  NT* Ks = Gs + kRows * E;   // [2][BK][E]
  NT* Vs = Ks + 2 * BK * E;  // [2][BK][E]
  // Heaviest first under causal masks (the last query tile has the most KV blocks; the dK/dV
  // grid is already in that order: key tile 0 is seen by every query).
  const int64_t i0 = static_cast<int64_t>(gridDim.x / kParts - 1 - blockIdx.x / kParts) * kRows, h = blockIdx.y,
                b = blockIdx.z;
  const int col0 = static_cast<int>(blockIdx.x % kParts) * EC;
  const int64_t hk = h / (p.Hq / p.Hkv), row = mask_row(p, b, h) * p.nQ + i0 / p.QB;
  const int64_t orow = (b * p.Hq + h) * p.L;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int wrow = 16 * MT * w;
  const NT* kbase = static_cast<const NT*>(p.k) + b * p.k_st[0] + hk * p.k_st[1];
  const NT* vbase = static_cast<const NT*>(p.v) + b * p.v_st[0] + hk * p.v_st[1];

  load_tile_async<kRows, E, kThreads>(Qs, static_cast<const NT*>(p.q) + b * p.q_st[0] + h * p.q_st[1], p.q_st[2], i0,
                                      p.L, tid);
  load_tile_async<kRows, E, kThreads>(Gs, static_cast<const NT*>(p.dout) + orow * E, E, i0, p.L, tid);

  auto issue = [&](const Cursor& c, int buf) {
    load_tile_async<BK, E, kThreads>(Ks + buf * BK * E, kbase, p.k_st[2], c.start, p.S, tid);
    load_tile_async<BK, E, kThreads>(Vs + buf * BK * E, vbase, p.v_st[2], c.start, p.S, tid);
  };
  Cursor cur;
  advance<BK, false>(p, b, h, 1, row, p.S, cur);
  if (cur.valid) issue(cur, 0);
  cp_async_commit();  // Q, dO and the first K/V tile: one group

  float lse[MT][2], del[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t i = i0 + wrow + 16 * mt + g + 8 * half;
      lse[mt][half] = exp_base<false>(i < p.L ? p.lse[orow + i] : -INFINITY);
      del[mt][half] = i < p.L ? p.delta[orow + i] : 0.0f;
    }
  float dq[MT][EC / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nf = 0; nf < EC / 8; ++nf)
#pragma unroll
      for (int r = 0; r < 4; ++r) dq[mt][nf][r] = 0.0f;

  for (int step = 0; cur.valid; ++step) {
    Cursor nxt = cur;
    advance<BK, false>(p, b, h, 1, row, p.S, nxt);
    const int buf = step & 1;
    cp_async_wait<0>();  // this step's tiles landed (this thread's copies) ...
    __syncthreads();     // ... everyone's; and every warp is done with buffer buf ^ 1 (previous step)
    if (nxt.valid) {
      issue(nxt, buf ^ 1);
      cp_async_commit();
    }

    const NT* Kb = Ks + buf * BK * E;
    const NT* Vb = Vs + buf * BK * E;
    uint32_t kept[MT];
    bool any = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      kept[mt] =
          kept_bits<BK, true>(p, mm, cur.pass == 0, true, int(b), int(h), int(i0) + wrow + 16 * mt, int(cur.start), lane);
      any = any || kept[mt] != 0;
    }
    if (__any_sync(0xffffffffu, any)) {  // else the warp's 16·MT × BK block is entirely masked
      float s[MT][BK / 8][4], dp[MT][BK / 8][4];
      rows_times_tile_t<NT, E, BK, MT>(s, Qs, wrow, Kb, lane);   // S = Q·Kᵀ
      rows_times_tile_t<NT, E, BK, MT>(dp, Gs, wrow, Vb, lane);  // dP = dO·Vᵀ
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nf = 0; nf < BK / 8; ++nf)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int i = int(i0) + wrow + 16 * mt + g + (r >> 1) * 8, j = int(cur.start) + nf * 8 + 2 * t + (r & 1);
            grad_elem(p, sm, (kept[mt] >> (nf * 4 + r)) & 1u, int(b), int(h), i, j, s[mt][nf][r], dp[mt][nf][r],
                      lse[mt][r >> 1], del[mt][r >> 1]);
          }
      acc_c_times_tile<NT, BK, EC, MT, E>(dq, dp, Kb, lane, col0);  // dQ += dS·K
    }
    cur = nxt;
  }
  cp_async_wait<0>();
  store_rows<NT, EC, MT, E>(dq, static_cast<NT*>(p.dq) + orow * E, i0 + wrow, p.L, lane, col0);
}

}  // namespace bwd
}  // namespace kiln::kernels::cuda::flex_mma
