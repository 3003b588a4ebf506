// The tensor-core FlexAttention forward (FlashAttention-2 style, mma.sync m16n8k16) for bf16 /
// f16 with E = Ev ∈ {64, 128}: flex_forward_mma, which returns false when it does not apply
// (f32, other head dims, block sizes not multiples of the tiles, rows not 16-byte aligned) so
// the caller falls back to the SIMT kernel of attention.cu.
//
// NOTE [flex forward mma]
// - A CTA of 4 warps owns kBM = 64 query rows of one (b, h); warp w owns rows 16w .. 16w + 15,
//   so every score row lives in one warp (softmax needs no shared memory). Q is loaded once and
//   kept in registers as A fragments (D/16 × 4 registers). Why 4 warps × 16 rows: with Q, O
//   (D/8 × 4 f32) and one 16 × 64 score tile in registers a thread needs ~150 registers for
//   D = 128, which leaves 2 CTAs (8 warps) per SM with 80 KB of shared memory each; 64-row CTAs
//   also divide the BlockMask's default 128-row blocks and the 64-row ones.
// - The CTA walks the KV blocks of its BlockMask row, partial ones first (mask_mod evaluated),
//   then full ones (mask skipped), each in kBN = 64-key sub-tiles. K and V sub-tiles are
//   double-buffered in swizzled shared memory with cp.async: sub-tile s + 1 is in flight while
//   s is computed. Rows beyond S are zero-filled and masked by the bounds check (applied only
//   on tiles that cross S; rows beyond L likewise, on the last query tile).
// - S = Q·Kᵀ (ldmatrix of K), mods in registers (attention_mma_common.cuh: score_mod always,
//   mask_mod on partial blocks), online softmax in f32 with exp2f (log2 e folded into one FMA),
//   P rounded to 16 bits and fed from registers as A fragments into O += P·V (ldmatrix.trans
//   of V). At the end O is divided by the row sum and lse = m + log(l) is written; a row with
//   nothing kept gets O = 0 and lse = -inf (never NaN).
// - GQA: K/V of head h / (Hq / Hkv), read in place with FlexParams' strides (no copies).
#pragma once
#include "kiln/core/error.h"
#include "kiln/kernels/cuda/attention_mma_common.cuh"

namespace kiln::kernels::cuda::flex_mma {

inline constexpr int kFwdWarps = 4;
inline constexpr int kFwdThreads = 32 * kFwdWarps;
inline constexpr int kFwdBM = 16 * kFwdWarps;  // query rows per CTA
inline constexpr int kFwdBN = 64;              // keys per sub-tile

template <int D> constexpr int fwd_smem_bytes() { return (kFwdBM + 4 * kFwdBN) * D * 2; }  // Q, 2 × (K, V)

template <class T, int D, class SM, class MM>
__global__ void __launch_bounds__(kFwdThreads, 2) flex_fwd_mma_kernel(FlexParams p, SM sm, MM mm) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kFwdBM * D;       // 2 stages of [kFwdBN × D]
  T* sV = sK + 2 * kFwdBN * D;   // 2 stages of [kFwdBN × D]
  constexpr int kSteps = D / 16;  // k16 steps of Q·Kᵀ
  constexpr int kNt = kFwdBN / 8;  // n8 tiles of a score row
  constexpr int kOt = D / 8;       // n8 tiles of an output row

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kFwdBM;
  const int64_t hk = h / (p.Hq / p.Hkv);
  const int L = static_cast<int>(p.L), S = static_cast<int>(p.S);
  const T* q = static_cast<const T*>(p.q) + b * p.q_st[0] + h * p.q_st[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_st[0] + hk * p.k_st[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_st[0] + hk * p.v_st[1];

  const int64_t row = mask_row(p, b, h) * p.nQ + q0 / p.QB;
  const FlexParams::BlockList part = p.kv_blocks(row, true), full = p.kv_blocks(row, false);
  const int sub = static_cast<int>(p.KB / kFwdBN);  // sub-tiles per KV block
  const int n_part = part.count * sub, n_steps = (part.count + full.count) * sub;
  auto step_kv0 = [&](int s) -> int64_t {  // first key of step s
    const int blk = s / sub;
    const int32_t idx = blk < part.count ? part.index[blk] : full.index[blk - part.count];
    return static_cast<int64_t>(idx) * p.KB + static_cast<int64_t>(s % sub) * kFwdBN;
  };
  auto load_kv = [&](int s, int stage) {
    const int64_t kv0 = step_kv0(s);
    load_tile_async<kFwdBN, D, kFwdThreads>(sK + stage * kFwdBN * D, k, p.k_st[2], kv0, S, tid);
    load_tile_async<kFwdBN, D, kFwdThreads>(sV + stage * kFwdBN * D, v, p.v_st[2], kv0, S, tid);
  };

  load_tile_async<kFwdBM, D, kFwdThreads>(sQ, q, p.q_st[2], q0, L, tid);
  cp_async_commit();
  if (n_steps > 0) load_kv(0, 0);
  cp_async_commit();
  cp_async_wait<1>();  // Q landed
  __syncthreads();
  uint32_t qa[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) ldmatrix_a<D>(qa[kk], sQ, 16 * warp, 16 * kk, lane);

  float o[kOt][4];
#pragma unroll
  for (int j = 0; j < kOt; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 (l: this lane's part)
  constexpr float kLog2e = 1.4426950408889634f;
  const int row0 = static_cast<int>(q0) + 16 * warp;
  const bool q_tail = q0 + kFwdBM > p.L;

  for (int s = 0; s < n_steps; ++s) {
    const int stage = s & 1;
    if (s + 1 < n_steps) load_kv(s + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // sub-tile s landed
    __syncthreads();
    const T* tK = sK + stage * kFwdBN * D;
    const T* tV = sV + stage * kFwdBN * D;
    const int kv0 = static_cast<int>(step_kv0(s));

    // S = Q·Kᵀ for this warp's 16 rows × 64 keys.
    float sc[kNt][4];
#pragma unroll
    for (int j = 0; j < kNt; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
      for (int np = 0; np < kNt / 2; ++np) {
        uint32_t bf[2][2];
        ldmatrix_b<D>(bf, tK, 16 * np, 16 * kk, lane);
        mma_16816<T>(sc[2 * np], qa[kk], bf[0]);
        mma_16816<T>(sc[2 * np + 1], qa[kk], bf[1]);
      }
    }

    // Mods (mask only on partial blocks, bounds only on tiles crossing L or S).
    const bool use_mask = s < n_part, bounds = q_tail || kv0 + kFwdBN > S;
#pragma unroll
    for (int j = 0; j < kNt; ++j)
      apply_mods<false>(sc[j], sm, mm, p.scale, b, h, row0, kv0 + 8 * j, lane, use_mask, bounds, L, S);

    // Online softmax: rows g (r = 0: c0, c1) and g + 8 (r = 1: c2, c3).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int j = 0; j < kNt; ++j) mx = fmaxf(mx, fmaxf(sc[j][2 * r], sc[j][2 * r + 1]));
      mx = quad_max(mx);
      // Nothing kept so far in this row: subtract 0 (every exp2 of -inf is 0, no inf - inf).
      const float base = mx == -INFINITY ? 0.0f : mx * kLog2e;
      const float alpha = m[r] == -INFINITY ? 0.0f : exp2f(m[r] * kLog2e - base);
      m[r] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kNt; ++j) {
        sc[j][2 * r] = exp2f(fmaf(sc[j][2 * r], kLog2e, -base));
        sc[j][2 * r + 1] = exp2f(fmaf(sc[j][2 * r + 1], kLog2e, -base));
        sum += sc[j][2 * r] + sc[j][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int j = 0; j < kOt; ++j) o[j][2 * r] *= alpha, o[j][2 * r + 1] *= alpha;
    }

    // O += P·V with P from registers.
#pragma unroll
    for (int kk = 0; kk < kFwdBN / 16; ++kk) {
      uint32_t pa[4];
      c_to_a<T>(pa, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < kOt / 2; ++np) {
        uint32_t bf[2][2];
        ldmatrix_b_trans<D>(bf, tV, 16 * kk, 16 * np, lane);
        mma_16816<T>(o[2 * np], pa, bf[0]);
        mma_16816<T>(o[2 * np + 1], pa, bf[1]);
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();

  // Normalise, store O and lse.
  const int g = lane >> 2, t = lane & 3;
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.Hq + h) * p.L * D;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lt = quad_sum(l[r]);
    inv[r] = lt > 0.0f ? 1.0f / lt : 0.0f;
    const int64_t i = row0 + g + 8 * r;
    if (t == 0 && i < p.L)
      p.lse[(static_cast<int64_t>(b) * p.Hq + h) * p.L + i] = lt > 0.0f ? m[r] + logf(lt) : -INFINITY;
  }
#pragma unroll
  for (int j = 0; j < kOt; ++j) {
    const float c[4] = {o[j][0] * inv[0], o[j][1] * inv[0], o[j][2] * inv[1], o[j][3] * inv[1]};
    store_c<T>(out, D, c, row0, 8 * j, p.L, lane);
  }
}

template <class T, int D, class SM, class MM>
void launch_fwd_mma(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  auto kernel = flex_fwd_mma_kernel<T, D, SM, MM>;
  constexpr int smem = fwd_smem_bytes<D>();
  if constexpr (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) fail("flex_attention (CUDA): cudaFuncSetAttribute: ", cudaGetErrorString(e));
  }
  const dim3 grid(static_cast<unsigned>((p.L + kFwdBM - 1) / kFwdBM), static_cast<unsigned>(p.Hq),
                  static_cast<unsigned>(p.B));
  kernel<<<grid, kFwdThreads, smem, st>>>(p, sm, mm);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail("flex_attention (CUDA): flex_fwd_mma_kernel launch: ", cudaGetErrorString(e));
}

// The tensor-core forward when it applies (see the top of the file); false: use another kernel.
// T is kiln's storage type (float, BFloat16, Half).
template <class T, class SM, class MM>
bool flex_forward_mma(const FlexParams& p, const SM& sm, const MM& mm, cudaStream_t st) {
  using CT = cuda_t<T>;
  if constexpr (std::is_void_v<CT>) {
    return false;
  } else {
    if (!mma_layout_ok(p, kFwdBM, kFwdBN)) return false;
    if (p.B == 0 || p.Hq == 0 || p.L == 0) return true;  // nothing to write
    if (p.E == 64) launch_fwd_mma<CT, 64>(p, sm, mm, st);
    else launch_fwd_mma<CT, 128>(p, sm, mm, st);
    return true;
  }
}

}  // namespace kiln::kernels::cuda::flex_mma
