// The tensor-core FlexAttention forward (FlashAttention-2 style, mma.sync m16n8k16) for bf16 /
// f16 with E = Ev ∈ {64, 128, 256}: flex_forward_mma, which returns false when it does not apply
// (f32, other head dims, block sizes not multiples of the tiles, rows not 16-byte aligned) so
// the caller falls back to the SIMT kernel of attention_kernels.cuh. (The Hopper forward takes
// 64 and 128 first; E = 256 runs here, with 64-row CTAs: O alone is 128 registers a thread.)
//
// NOTE [flex forward mma]
// - A CTA of 4 warps owns 64·MT query rows of one (b, h): MT = 2 (128 rows, warp w owns rows
//   32w .. 32w + 31 as two m16 tiles) when the BlockMask's q blocks are multiples of 128 (the
//   default), else MT = 1 (64 rows, 16 per warp). With two m16 tiles per warp every K/V
//   B fragment read from shared memory (ldmatrix) feeds two mma instead of one (~32 FLOP per
//   shared byte: the SM becomes tensor-bound instead of shared-memory bound). Every score row
//   lives in one warp (softmax needs no shared memory).
// - Q stays in shared memory and its A fragments are re-read per k16 step (FlashAttention-2's
//   default): keeping them in registers (64 more at D = 128) next to O (MT·D/2 f32) and the
//   MT × 16 × 64 score tile would exceed 255 registers. __launch_bounds__(128, 2) at D = 128:
//   shared memory is 32 KB of Q + 2 × (K, V) 64 KB = 96 KB, so 2 CTAs (8 warps) share an SM and
//   one CTA's softmax overlaps the other's mma.
// - The CTA walks the KV blocks of its BlockMask row, partial ones first (mask_mod evaluated),
//   then full ones (mask skipped), each in 64-key sub-tiles (32 at D = 256). K and V sub-tiles are
//   double-buffered in swizzled shared memory with cp.async; Q and the first sub-tile are
//   issued together (short prologue for windowed masks with few sub-tiles). One
//   __syncthreads per sub-tile: at the top of step s the CTA waits for sub-tile s, syncs (which
//   also proves every warp is done with the other stage, read in step s − 1), then issues
//   sub-tile s + 1 into that stage and computes s while it flies. Rows beyond S are zero-filled
//   and masked by the bounds check (applied only on tiles that cross S; rows beyond L likewise,
//   on the last query tile).
// - CTAs are scheduled heaviest-first for causal-like masks: blockIdx.x = 0 takes the last query
//   tile (the one with the most KV blocks under causal masks), which shortens the tail of the
//   last wave; for other masks the order changes nothing.
// - S = Q·Kᵀ (ldmatrix of Q and K), mods in registers (attention_mma_common.cuh: score_mod
//   always, mask_mod on partial blocks), online softmax in f32 with exp2f (log2 e folded into
//   one FMA), P rounded to 16 bits and fed from registers as A fragments into O += P·V
//   (ldmatrix.trans of V). A sub-tile that masks every pair of a warp's rows is skipped by that
//   warp after S (softmax and P·V). At the end O is divided by the row sum and lse = m + log(l)
//   is written; a row with nothing kept gets O = 0 and lse = -inf (never NaN).
// - GQA: K/V of head h / (Hq / Hkv), read in place with FlexParams' strides (no copies).
#pragma once
#include <type_traits>

#include "kiln/core/error.h"
#include "kiln/kernels/cuda/attention_host.cuh"
#include "kiln/kernels/cuda/attention_mma_common.cuh"

namespace kiln::kernels::cuda::flex_mma {

// Keys per sub-tile: 64; 32 at D = 256, where 64-key stages take 160 KB of shared memory and
// leave one CTA an SM; with 32, 96 KB and two CTAs, one's softmax beside the other's mma (H200,
// bf16, causal, B = 1, H = 16: S = 4096 1.20 → 0.93 ms, S = 16384 16.3 → 11.5 ms).
template <int D> constexpr int fwd_bn() { return D == 256 ? 32 : 64; }
inline constexpr int kFwdWarps = 4;    // warps per CTA
inline constexpr int kFwdThreads = 32 * kFwdWarps;

// MT m16 tiles per warp: the CTA owns 64·MT rows. Shared memory: Q, 2 × (K, V).
template <int D, int MT> constexpr int fwd_smem_bytes() { return (16 * MT * kFwdWarps + 4 * fwd_bn<D>()) * D * 2; }
// CTAs per SM the register allocation must allow (smem: 96 / 80 KB at D = 128, 48 / 40 KB at 64;
// D = 64 with two m16 tiles needs ~250 registers, so 2 CTAs; with one, 3 CTAs at ≤ 168).
// D = 256 (MT = 1 only, O is 128 registers): two CTAs with 32-key sub-tiles (96 KB each).
template <int D, int MT> constexpr int fwd_min_blocks() { return D == 128 || D == 256 ? 2 : (MT == 2 ? 2 : 3); }
// Keys per online-softmax update within a 64-key sub-tile: 32 where the MT × 16 × 64 f32 score
// tile would not fit in the registers next to O (D = 128 with two m16 tiles per warp).
template <int D, int MT> constexpr int fwd_chunk() { return D * MT >= 256 ? 32 : 64; }

template <class T, int D, int MT, class SM, class MM>
__global__ void __launch_bounds__(kFwdThreads, fwd_min_blocks<D, MT>()) flex_fwd_mma_kernel(FlexParams p, SM sm,
                                                                                           MM mm) {
  constexpr int kBM = 16 * MT * kFwdWarps;
  extern __shared__ __align__(128) unsigned char fwd_smem[];
  T* sQ = reinterpret_cast<T*>(fwd_smem);
  constexpr int kFwdBN = fwd_bn<D>();  // keys per sub-tile
  T* sK = sQ + kBM * D;          // 2 stages of [kFwdBN × D]
  T* sV = sK + 2 * kFwdBN * D;   // 2 stages of [kFwdBN × D]
  constexpr int kSteps = D / 16;   // k16 steps of Q·Kᵀ
  constexpr int kCN = fwd_chunk<D, MT>();  // keys per softmax update
  constexpr int kNt = kCN / 8;             // n8 tiles of a score chunk row
  constexpr int kOt = D / 8;       // n8 tiles of an output row

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t q0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kBM;  // heaviest (causal) first
  const int64_t hk = h / (p.Hq / p.Hkv);
  const int L = static_cast<int>(p.L), S = static_cast<int>(p.S);
  const T* q = static_cast<const T*>(p.q) + b * p.q_st[0] + h * p.q_st[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_st[0] + hk * p.k_st[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_st[0] + hk * p.v_st[1];

  const KvSteps<kFwdBN> steps(p, b, h, q0);
  const int n_part = steps.n_part, n_steps = steps.n;
  auto load_kv = [&](int s, int stage) {
    const int64_t kv0 = steps.kv0(p, s);
    load_tile_async<kFwdBN, D, kFwdThreads>(sK + stage * kFwdBN * D, k, p.k_st[2], kv0, S, tid);
    load_tile_async<kFwdBN, D, kFwdThreads>(sV + stage * kFwdBN * D, v, p.v_st[2], kv0, S, tid);
  };

  // Prologue: Q and the first K/V sub-tile in one group.
  load_tile_async<kBM, D, kFwdThreads>(sQ, q, p.q_st[2], q0, L, tid);
  if (n_steps > 0) load_kv(0, 0);
  cp_async_commit();

  float o[MT][kOt][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < kOt; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.0f;
  // Rows g (r = 0) and g + 8 (r = 1) of each m16 tile; l is this lane's part of the row sum.
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
  const int wrow = 16 * MT * warp;  // the warp's first row within the CTA tile
  const int row0 = static_cast<int>(q0) + wrow;
  const bool q_tail = q0 + kBM > p.L;

  for (int s = 0; s < n_steps; ++s) {
    const int stage = s & 1;
    cp_async_wait<0>();  // sub-tile s (and, at s = 0, Q) landed for this thread ...
    __syncthreads();     // ... and for all; every warp is also done with stage ^ 1 (step s - 1)
    if (s + 1 < n_steps) {
      load_kv(s + 1, stage ^ 1);
      cp_async_commit();
    }
    const T* tK = sK + stage * kFwdBN * D;
    const T* tV = sV + stage * kFwdBN * D;
    const int kv_tile = static_cast<int>(steps.kv0(p, s));
    const bool use_mask = s < n_part, bounds = q_tail || kv_tile + kFwdBN > S;

    // The 64-key sub-tile in kCN-key chunks (one online-softmax update each).
#pragma unroll 1
    for (int c0 = 0; c0 < kFwdBN; c0 += kCN) {
      const int kv0 = kv_tile + c0;
      // S = Q·Kᵀ for this warp's 16·MT rows × kCN keys; each K fragment feeds MT mma.
      float sc[MT][kNt][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < kNt; ++j) sc[mt][j][0] = sc[mt][j][1] = sc[mt][j][2] = sc[mt][j][3] = 0.0f;
#pragma unroll 1  // kk only moves the ldmatrix addresses; unrolled, ptxas hoists loads and spills
      for (int kk = 0; kk < kSteps; ++kk) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_a<D>(qa[mt], sQ, wrow + 16 * mt, 16 * kk, lane);
#pragma unroll
        for (int np = 0; np < kNt / 2; ++np) {
          uint32_t bf[2][2];
          ldmatrix_b<D>(bf, tK, c0 + 16 * np, 16 * kk, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(sc[mt][2 * np], qa[mt], bf[0]);
            mma_16816<T>(sc[mt][2 * np + 1], qa[mt], bf[1]);
          }
        }
      }

      // Mods (mask only on partial blocks, bounds only on tiles crossing L or S).
      with_mask_flags(use_mask, bounds, [&]<bool kMask, bool kBounds>() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 0; j < kNt; ++j)
            apply_mods<kMask, kBounds, true>(sc[mt][j], sm, mm, p.scale, b, h, row0 + 16 * mt, kv0 + 8 * j, lane, L, S);
      });

      // A chunk that masks every pair of this warp's rows changes nothing (m, l and O stay):
      // skip its softmax and P·V (warp-uniform).
      bool live = true;
      if (use_mask || bounds) {
        bool any = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 0; j < kNt; ++j)
            any = any || sc[mt][j][0] != -INFINITY || sc[mt][j][1] != -INFINITY || sc[mt][j][2] != -INFINITY ||
                  sc[mt][j][3] != -INFINITY;
        live = __any_sync(0xffffffffu, any);
      }
      if (!live) continue;

      // Online softmax per row.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = m[mt][r];
#pragma unroll
          for (int j = 0; j < kNt; ++j) mx = fmaxf(mx, fmaxf(sc[mt][j][2 * r], sc[mt][j][2 * r + 1]));
          mx = quad_max(mx);
          // Nothing kept so far in this row: subtract 0 (every exp2 of -inf is 0, no inf - inf).
          const float base = mx == -INFINITY ? 0.0f : mx * kLog2e;
          const float alpha = m[mt][r] == -INFINITY ? 0.0f : exp2f(m[mt][r] * kLog2e - base);
          m[mt][r] = mx;
          float sum = 0.0f;
#pragma unroll
          for (int j = 0; j < kNt; ++j) {
            sc[mt][j][2 * r] = exp2f(fmaf(sc[mt][j][2 * r], kLog2e, -base));
            sc[mt][j][2 * r + 1] = exp2f(fmaf(sc[mt][j][2 * r + 1], kLog2e, -base));
            sum += sc[mt][j][2 * r] + sc[mt][j][2 * r + 1];
          }
          l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
          for (int j = 0; j < kOt; ++j) o[mt][j][2 * r] *= alpha, o[mt][j][2 * r + 1] *= alpha;
        }

      // O += P·V with P from registers; each V fragment feeds MT mma.
#pragma unroll
      for (int kk = 0; kk < kCN / 16; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) c_to_a<T>(pa[mt], sc[mt][2 * kk], sc[mt][2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < kOt / 2; ++np) {
          uint32_t bf[2][2];
          ldmatrix_b_trans<D>(bf, tV, c0 + 16 * kk, 16 * np, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(o[mt][2 * np], pa[mt], bf[0]);
            mma_16816<T>(o[mt][2 * np + 1], pa[mt], bf[1]);
          }
        }
      }
    }  // chunks
  }
  cp_async_wait<0>();  // n_steps == 0: the Q copy is still owned by this thread

  // Normalise, store O and lse.
  const int g = lane >> 2, t = lane & 3;
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.Hq + h) * p.L * D;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lt = quad_sum(l[mt][r]);
      inv[r] = lt != 0.0f ? 1.0f / lt : 0.0f;  // 0: nothing kept; NaN (a NaN score) stays NaN
      const int64_t i = row0 + 16 * mt + g + 8 * r;
      if (t == 0 && i < p.L)
        p.lse[(static_cast<int64_t>(b) * p.Hq + h) * p.L + i] = lt != 0.0f ? m[mt][r] + logf(lt) : -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < kOt; ++j) {
      const float c[4] = {o[mt][j][0] * inv[0], o[mt][j][1] * inv[0], o[mt][j][2] * inv[1], o[mt][j][3] * inv[1]};
      store_c<T>(out, D, c, row0 + 16 * mt, 8 * j, p.L, lane);
    }
  }
}

template <class T, int D, int MT, class SM, class MM>
void launch_fwd_mma(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  constexpr int kBM = 16 * MT * kFwdWarps;
  auto kernel = flex_fwd_mma_kernel<T, D, MT, SM, MM>;
  constexpr int smem = fwd_smem_bytes<D, MT>();
  set_smem(kernel, smem);
  const dim3 grid(static_cast<unsigned>((p.L + kBM - 1) / kBM), static_cast<unsigned>(p.Hq),
                  static_cast<unsigned>(p.B));
  kernel<<<grid, kFwdThreads, smem, st>>>(p, sm, mm);
  KILN_CUDA_CHECK_LAUNCH("flex_fwd_mma_kernel");
}

// The tensor-core forward when it applies (see the top of the file); false: use another kernel.
// T is kiln's storage type (float, BFloat16, Half).
template <class T, class SM, class MM>
bool flex_forward_mma(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  using CT = cuda_t<T>;
  if constexpr (std::is_void_v<CT>) {
    return false;
  } else {
    if (!mma_layout_ok(p, 64, 64, /*head_dim_256=*/true)) return false;  // blocks multiples of 64
    if (p.E == 256 && current_context().max_shared_per_block < static_cast<size_t>(fwd_smem_bytes<256, 1>()))
      return false;
    if (p.B == 0 || p.Hq == 0 || p.L == 0) return true;  // nothing to write
    // 128-row CTAs (two m16 tiles per warp) when the BlockMask's q blocks allow it, else 64 rows.
    const bool wide = p.QB % 128 == 0;
    if (p.E == 64) wide ? launch_fwd_mma<CT, 64, 2>(p, sm, mm, st) : launch_fwd_mma<CT, 64, 1>(p, sm, mm, st);
    else if (p.E == 128) wide ? launch_fwd_mma<CT, 128, 2>(p, sm, mm, st) : launch_fwd_mma<CT, 128, 1>(p, sm, mm, st);
    else launch_fwd_mma<CT, 256, 1>(p, sm, mm, st);
    return true;
  }
}

}  // namespace kiln::kernels::cuda::flex_mma
