// The SIMT FlexAttention kernels, device-only (no host code: the JIT's NVRTC sources include it
// too, kernels/device_std.h), launched by attention_kernels.cuh: one thread owns one query row
// (forward, dQ) or one kv row (dK/dV), iterating the BlockMask's tile lists (partial tiles
// evaluate the mask_mod, full tiles skip it, empty tiles are never visited), f32 math on the
// storage type T (float, or kiln's BFloat16 / Half where the includer provides them), any
// length, GQA, fully masked rows → 0 / −inf; the backward bitwise deterministic (one owner per
// output row, fixed order). The NOTE at the top of attention_kernels.cuh says more.
#pragma once
#include "kiln/kernels/device_std.h"
#include "kiln/kernels/flex_mods.h"
#include "kiln/kernels/flex_params.h"
#include "kiln/kernels/flex_tiles.h"

namespace kiln::kernels::cuda::flex_simt {

// Each kernel is a __global__ wrapper of a __device__ body, so that a generated source (the JIT's
// run-time mods) can wrap the same body in an extern "C" kernel of its own.

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
__device__ __forceinline__ void flex_fwd_body(FlexParams p, SM sm, MM mm) {
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
template <int MAXD, class T, class SM, class MM>
__global__ void flex_fwd_kernel(FlexParams p, SM sm, MM mm) {
  flex_fwd_body<MAXD, T>(p, sm, mm);
}

template <class T>
__device__ __forceinline__ void flex_delta_body(FlexParams p) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= p.B * p.Hq * p.L) return;
  const T* o = static_cast<const T*>(p.out) + r * p.Ev;
  const T* g = static_cast<const T*>(p.dout) + r * p.Ev;
  float d = 0.0f;
  for (int e = 0; e < p.Ev; ++e) d += static_cast<float>(o[e]) * static_cast<float>(g[e]);
  p.delta[r] = d - (p.dlse ? p.dlse[r] : 0.0f);
}
template <class T>
__global__ void flex_delta_kernel(FlexParams p) {
  flex_delta_body<T>(p);
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
__device__ __forceinline__ void flex_dq_body(FlexParams p, SM sm, MM mm) {
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
__global__ void flex_dq_kernel(FlexParams p, SM sm, MM mm) {
  flex_dq_body<MAXD, T>(p, sm, mm);
}

template <int MAXD, class T, class SM, class MM>
__device__ __forceinline__ void flex_dkdv_body(FlexParams p, SM sm, MM mm) {
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
template <int MAXD, class T, class SM, class MM>
__global__ void flex_dkdv_kernel(FlexParams p, SM sm, MM mm) {
  flex_dkdv_body<MAXD, T>(p, sm, mm);
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

// Part 2: dbias[h, r] = Σ_b Σ_qb partial[b, h, qb, r], in that order. A template (of nothing) so
// that every instantiation file including this header shares one definition, as the others do.
template <int = 0>
__global__ void flex_dbias_reduce_kernel(FlexParams p) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= p.Hq * p.bias_row) return;
  const int64_t h = x / p.bias_row, r = x % p.bias_row;
  float sum = 0.0f;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t qb = 0; qb < p.nQ; ++qb) sum += p.dbias_partial[((b * p.Hq + h) * p.nQ + qb) * p.bias_row + r];
  p.dbias[x] = sum;
}

}  // namespace kiln::kernels::cuda::flex_simt
