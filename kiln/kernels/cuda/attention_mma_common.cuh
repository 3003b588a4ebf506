// Pieces shared by the tensor-core FlexAttention kernels (mma.sync: attention_fwd_mma.cuh and
// attention_bwd_mma.cuh; Hopper: attention_fwd_wgmma.cuh and attention_bwd_wgmma.cuh, whose
// accumulators have the same fragment layout), device-only (NVRTC compiles it for the JIT's
// run-time mods, kernels/device_std.h; the launchers' host helpers are in attention_host.cuh):
// the mask row of (b, h), a forward query tile's walk over its KV sub-tiles, the cp.async loader
// of a [rows × D] tile into a swizzled shared tile, the branch-free kept test of one (q, kv) pair
// with the per-case dispatch of the mask and bounds flags, the application of score_mod + mask_mod + bounds to one m16n8 f32 accumulator fragment of
// S = Q·Kᵀ, the quad (4-lane) row reductions of m16n8 fragments and the C → A fragment
// repacking of P.
//
// NOTE [fragment coordinates] (see NOTE [m16n8k16 fragments] in mma.cuh): lane = 4·g + t; the
// C fragment of an m16n8 tile at (row0, col0) holds c[i] at row row0 + g + 8·(i / 2) and column
// col0 + 2t + (i % 2). A row of the tile lives in the 4 lanes of one quad (same g).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kiln/kernels/device_std.h"
#include "kiln/kernels/flex_params.h"
#include "kiln/kernels/cuda/mma.cuh"

namespace kiln::kernels::cuda::flex_mma {

using namespace ::kiln::kernels::cuda::mma;

// log2 e: the tensor-core kernels take exp(x) as 2^(x·kLog2e) (exp2 on the special-function unit).
inline constexpr float kLog2e = 1.4426950408889634f;

// The row of the BlockMask's (Bm, Hm) planes that (b, h) reads (1 broadcasts).
__host__ __device__ __forceinline__ int64_t mask_row(const FlexParams& p, int64_t b, int64_t h) {
  return (p.Bm == 1 ? 0 : b) * p.Hm + (p.Hm == 1 ? 0 : h);
}

// The STEP-key sub-tiles a forward query tile (first row q0, inside one q block) visits, in
// order: its BlockMask row's partial KV blocks first (mask_mod evaluated), then the full ones.
template <int STEP> struct KvSteps {
  FlexParams::BlockList part, full;
  int sub, n_part, n;  // sub-tiles per KV block; steps on partial blocks; all steps
  __device__ __forceinline__ KvSteps(const FlexParams& p, int b, int h, int64_t q0) {
    // 32-bit division (mma_layout_ok: q0 < L < 2^31, QB < 2^31): a 64-bit one is a call.
    const int64_t row = mask_row(p, b, h) * p.nQ + static_cast<int32_t>(q0) / static_cast<int32_t>(p.QB);
    part = p.kv_blocks(row, true);
    full = p.kv_blocks(row, false);
    sub = static_cast<int>(p.KB / STEP);
    n_part = part.count * sub;
    n = (part.count + full.count) * sub;
  }
  __device__ __forceinline__ int64_t kv0(const FlexParams& p, int s) const {  // first key of step s
    const int blk = s / sub;
    const int32_t idx = blk < part.count ? part.index[blk] : full.index[blk - part.count];
    return static_cast<int64_t>(idx) * p.KB + static_cast<int64_t>(s - blk * sub) * STEP;
  }
};

// Copies rows row0 .. row0 + ROWS - 1 of a [len × COLS] matrix of 16-bit elements (row r at
// base + r·stride, 16-byte aligned) into the swizzled shared tile `tile` ([ROWS × COLS], see
// mma::swz) with cp.async; rows ≥ len are zero-filled. All NT threads of the CTA call it with
// their tid; the caller commits the group (cp_async_commit) and waits.
template <int ROWS, int COLS, int NT, class T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* base, int64_t stride, int64_t row0, int64_t len,
                                                int tid) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  constexpr int kChunks = COLS / 8;          // 16-byte chunks per row
  static_assert(NT % kChunks == 0 && ROWS % (NT / kChunks) == 0, "tile chunks must divide among the threads");
  constexpr int kRowsPerIt = NT / kChunks;   // rows the CTA copies per iteration
  // A thread copies chunk tid % kChunks of rows tid / kChunks + kRowsPerIt·it: one source
  // pointer and one shared address advanced by constants (few live registers in callers), as
  // long as its rows keep their swizzle phase (row % 8); with fewer rows an iteration (COLS =
  // 256: 4) the shared address is swizzled per row.
  constexpr bool kSamePhase = kRowsPerIt % 8 == 0;
  const int r0 = tid / kChunks, c = (tid % kChunks) * 8;
  const int64_t rem = len - row0 - r0;  // rows of this thread's column still in range
  const T* src = base + (row0 + r0) * stride + c;
  const uint32_t dst = smem_addr(tile + swz<COLS>(r0, c));
#pragma unroll
  for (int it = 0; it < ROWS / kRowsPerIt; ++it) {
    const bool ok = it * kRowsPerIt < rem;
    const uint32_t at =
        kSamePhase ? dst + it * kRowsPerIt * COLS * 2 : smem_addr(tile + swz<COLS>(r0 + it * kRowsPerIt, c));
    cp_async_16(at, ok ? src : base, ok);  // base: a valid address when unused
    src += kRowsPerIt * stride;
  }
}

// Whether the pair (q, kv) is kept. kMask: mask_mod is evaluated (partial blocks); kBounds:
// q < L and kv < S are checked (tiles crossing L or S), and q and kv are then clamped into range,
// so the mods never see an index out of range (their answer there is discarded). Branch-free:
// the parts combine with & (no short-circuit). On return q and kv are the indices the mods may
// be called with.
template <bool kMask, bool kBounds, class MM>
__device__ __forceinline__ bool kept_pair(const MM& mm, int b, int h, int& q, int& kv, int L, int S) {
  bool keep = true;
  if constexpr (kBounds) {
    keep = (q < L) & (kv < S);
    q = min(q, L - 1);
    kv = min(kv, S - 1);
  }
  if constexpr (kMask) keep = keep & mm(b, h, q, kv);
  return keep;
}

// Calls f.template operator()<kMask, kBounds>() for the warp-uniform runtime flags, so that the
// element code is compiled once per case with no per-element test.
template <class F>
__device__ __forceinline__ void with_mask_flags(bool use_mask, bool check_bounds, F&& f) {
  if (use_mask) {
    if (check_bounds)
      f.template operator()<true, true>();
    else
      f.template operator()<true, false>();
  } else if (check_bounds) {
    f.template operator()<false, true>();
  } else {
    f.template operator()<false, false>();
  }
}

// score_mod + mask_mod + bounds on one m16n8 f32 accumulator fragment of raw dot products
// S = Q·Kᵀ (rows are queries, columns keys; (row0, col0) the absolute coordinates of the
// fragment's (0, 0)). On return c[i] is score_mod(scale · dot), or -INFINITY where the pair is
// masked (mask_mod false, evaluated when kMask: partial blocks) or out of range (q ≥ L or
// kv ≥ S, checked when kBounds; see kept_pair). kScore = false (an identity score_mod whose
// scale the caller folds into its exponent): kept elements stay the raw dot products.
// scale · dot is rounded on its own (__fmul_rn is never contracted): left to the compiler, it
// fused into a score_mod's last add (ALiBi: fma(dot, scale, slope · d)) in nvcc's build but not
// in NVRTC's (fma(slope, d, dot · scale)), so a run-time mod lost the built-in's bits.
template <bool kMask, bool kBounds, bool kScore, class SM, class MM>
__device__ __forceinline__ void apply_mods(float (&c)[4], const SM& sm, const MM& mm, float scale, int b, int h,
                                           int row0, int col0, int lane, int L, int S) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    int q = row0 + g + 8 * (i >> 1), kv = col0 + 2 * t + (i & 1);
    const bool keep = kept_pair<kMask, kBounds>(mm, b, h, q, kv, L, S);
    float x = c[i];
    if constexpr (kScore) x = sm(__fmul_rn(x, scale), b, h, q, kv);
    c[i] = keep ? x : -INFINITY;
  }
}

// Max / sum over the 4 lanes of a quad (one fragment row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Two C fragments (columns 16·kk .. 16·kk + 7 and 16·kk + 8 .. 16·kk + 15 of a 16-row tile),
// rounded to T, as the A fragment of the k16 step kk (see mma.cuh: P·V from registers).
template <class T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// Stores the C fragment of an m16n8 tile (f32) at rows row0.., cols col0.. of a row-major
// [rows × ld] T matrix, rows ≥ nrows skipped (col0 + 8 ≤ ld assumed).
template <class T>
__device__ __forceinline__ void store_c(T* out, int64_t ld, const float (&c)[4], int64_t row0, int col0,
                                        int64_t nrows, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hrow = 0; hrow < 2; ++hrow) {
    const int64_t r = row0 + g + 8 * hrow;
    if (r < nrows)
      *reinterpret_cast<uint32_t*>(out + r * ld + col0 + 2 * t) = pack2<T>(c[2 * hrow], c[2 * hrow + 1]);
  }
}

}  // namespace kiln::kernels::cuda::flex_mma
