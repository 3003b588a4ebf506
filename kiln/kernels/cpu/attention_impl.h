// CPU FlexAttention bodies (templates over the storage type T and the mods).
//
// Forward: one task per (b, h, q-block): online softmax over the block's kv tiles (partial tiles
// evaluate the mask_mod, full tiles skip it, empty tiles are never visited), f32 math.
// Backward, FlashAttention-2 style with recomputation and one owner per output (bitwise
// deterministic, no atomics):
//   dQ pass, one task per (b, h, q-block): recompute P from the saved lse, dP = dO·Vᵀ,
//     dS = P ∘ (dP − Δ) ∘ score_mod', dQ = scale · dS·K (and the learnable bias's per-task
//     partial row, reduced afterwards over (b, q-block) in a fixed order);
//   dK/dV pass, one task per (b, h_kv, kv-block) over the transposed lists (partial and full
//     merged in block order) and the query heads of its GQA group: dV = Pᵀ·dO, dK = scale · dSᵀ·Q;
//   or, where B · H_kv covers the threads, both in one pass, one task per (b, h_kv), each tile's
//     P and dS formed once (the same sums in the same order: the same bits).
// Extra memory per thread is O(block · (E + Ev + block)), the one-pass form's plus S · (E + Ev);
// inner loops run over contiguous f32 rows (`omp simd`), exp is a vectorisable polynomial (fast_expf).
#pragma once
#include <cstdint>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kiln/kernels/flex_mods.h"
#include "kiln/core/dtype.h"
#include "kiln/kernels/attention.h"
#include "kiln/kernels/cpu/vec_math.h"

namespace kiln::kernels::cpu {

namespace flex_detail {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <class T>
inline void load_row(float* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else {
    for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<float>(src[e]);
  }
}
template <class T>
inline void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<T>(src[e]);
}
// dst[e * ld + j] = src row j, element e (a transposed tile of nrows rows).
template <class T>
inline void load_transposed(float* dst, int64_t ld, const T* src, int64_t row_stride, int64_t nrows, int64_t n) {
  for (int64_t j = 0; j < nrows; ++j) {
    const T* r = src + j * row_stride;
    for (int64_t e = 0; e < n; ++e) dst[e * ld + j] = static_cast<float>(r[e]);
  }
}
// Tile products (kernels/cpu/attention.cpp and attention_wx.cpp, compiled for AVX2+FMA and the
// baseline, picked at load time), register blocks of kTileRows × kTileCols outputs:
constexpr int64_t kTileRows = 4, kTileCols = 16;
// s[i * ld + j] = sum_e a[i * n + e] * bt[e * ld + j] for i < m, j < nk.
void tile_abt(float* s, int64_t ld, const float* a, int64_t m, int64_t n, const float* bt, int64_t nk);
// acc[r * n + :] += sum_c w[r * ld + c] * x[c * n + :] (w indexed by (row, col)).
void tile_ax(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols);
// acc[c * n + :] += sum_r w[r * ld + c] * x[r * n + :] (the transposed product).
void tile_atx(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols);
// Row loops of the online softmax and its gradient (same file, same dispatch):
// sum_e a[e] * b[e] in increasing e: the order (and FMA use) of one element of tile_abt, so that
// Δ = rowsum(dO ∘ O) cancels exactly against dP where P is one-hot (e.g. a window of 1).
float row_dot(const float* a, const float* b, int64_t n);
// max over s[0..n) (-inf for n == 0).
float row_max(const float* s, int64_t n);
// s[j] = fast_expf(s[j] - m) for j < n; returns the sum of the new s.
float row_exp_sum(float* s, int64_t n, float m);
// s[j] = P = fast_expf(s[j] - lse), d[j] = P * (d[j] - delta) for j < n.
void row_softmax_grad(float* s, float* d, int64_t n, float lse, float delta);

struct Geo {
  const FlexParams& p;
  int64_t mask_row(int64_t b, int64_t h) const { return ((p.Bm == 1 ? 0 : b) * p.Hm + (p.Hm == 1 ? 0 : h)); }
};

// f(j0, nk, partial) for each kv block of mask row `row` (a q block): the partial blocks (the
// mask evaluated) first, then the full ones, each in its list's order; empty blocks never.
template <class F>
inline void for_each_kv_block(const FlexParams& p, int64_t row, F&& f) {
  for (int pass = 0; pass < 2; ++pass) {
    const bool partial = pass == 0;
    const auto [cnt, idx] = p.kv_blocks(row, partial);
    for (int32_t c = 0; c < cnt; ++c) {
      const int64_t j0 = static_cast<int64_t>(idx[c]) * p.KB;
      f(j0, std::min(p.KB, p.S - j0), partial);
    }
  }
}

// Scores of one tile after the score_mod and the mask: s holds raw scale·q·k on entry; on exit
// x (−inf where masked). raw (optional) keeps the scaled pre-mod score for score_mod'.
template <class SM, class MM>
inline void apply_mods(float* s, int64_t ld, float* raw, int64_t nq, int64_t nk, int64_t i0, int64_t j0, int b, int h,
                       float scale, const SM& sm, const MM& mm, bool partial) {
  for (int64_t i = 0; i < nq; ++i) {
    float* si = s + i * ld;
    const int qi = static_cast<int>(i0 + i);
    if constexpr (std::is_same_v<SM, attention::NoScoreMod>) {
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) si[j] *= scale;
      if (raw) std::memcpy(raw + i * ld, si, static_cast<size_t>(nk) * sizeof(float));
    } else {
      for (int64_t j = 0; j < nk; ++j) {
        const float r = si[j] * scale;
        if (raw) raw[i * ld + j] = r;
        si[j] = sm(r, b, h, qi, static_cast<int>(j0 + j));
      }
    }
    if (partial) {
      // A select, not a conditional store, so that it vectorises (mask_mods are pure functions).
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) si[j] = mm(b, h, qi, static_cast<int>(j0 + j)) ? si[j] : kNegInf;
    }
  }
}

}  // namespace flex_detail

template <class T, class SM, class MM>
void flex_forward(const FlexParams& p, const SM& sm, const MM& mm) {
  using namespace flex_detail;
  const int64_t QB = p.QB, KB = p.KB, E = p.E, Ev = p.Ev, G = p.Hq / p.Hkv;
  // A tile's rows and columns at most: the scratch tiles' extents and leading dimension (a block
  // larger than the sequence allocates only the sequence).
  const int64_t QT = std::min(QB, p.L), KT = std::min(KB, p.S);
  const int64_t tasks = p.B * p.Hq * p.nQ;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
#pragma omp parallel if (tasks > 1)
  {
    std::vector<float> qf(QT * E), kt(E * KT), vf(KT * Ev), s(QT * KT), acc(QT * Ev), m(QT), l(QT);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t qb = t % p.nQ, h = (t / p.nQ) % p.Hq, b = t / (p.nQ * p.Hq), hk = h / G;
      const int64_t i0 = qb * QB, nq = std::min(QB, p.L - i0);
      for (int64_t i = 0; i < nq; ++i) load_row(&qf[i * E], q + b * p.q_st[0] + h * p.q_st[1] + (i0 + i) * p.q_st[2], E);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.0f);
      const int64_t row = Geo{p}.mask_row(b, h) * p.nQ + qb;
      const T* kbase = k + b * p.k_st[0] + hk * p.k_st[1];
      const T* vbase = v + b * p.v_st[0] + hk * p.v_st[1];
      for_each_kv_block(p, row, [&](int64_t j0, int64_t nk, bool partial) {
        load_transposed(kt.data(), KT, kbase + j0 * p.k_st[2], p.k_st[2], nk, E);
        for (int64_t j = 0; j < nk; ++j) load_row(&vf[j * Ev], vbase + (j0 + j) * p.v_st[2], Ev);
        tile_abt(s.data(), KT, qf.data(), nq, E, kt.data(), nk);
        apply_mods(s.data(), KT, nullptr, nq, nk, i0, j0, static_cast<int>(b), static_cast<int>(h), p.scale, sm, mm,
                   partial);
        for (int64_t i = 0; i < nq; ++i) {
          float* si = &s[i * KT];
          const float mx = row_max(si, nk);
          const float mnew = std::max(m[i], mx);
          if (mnew == kNegInf) {  // everything masked so far, or NaN (row_max skips NaN)
            bool nan = false;
            for (int64_t j = 0; j < nk; ++j) nan = nan || std::isnan(si[j]), si[j] = 0.0f;
            if (nan) m[i] = l[i] = std::numeric_limits<float>::quiet_NaN();  // the row's output and lse
            continue;
          }
          const float alpha = fast_expf(m[i] - mnew);
          const float sum = row_exp_sum(si, nk, mnew);
          l[i] = l[i] * alpha + sum;
          m[i] = mnew;
          if (alpha != 1.0f) {
            float* ai = &acc[i * Ev];
#pragma omp simd
            for (int64_t e = 0; e < Ev; ++e) ai[e] *= alpha;
          }
        }
        tile_ax(acc.data(), Ev, s.data(), KT, nq, vf.data(), nk);
      });
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t o = (b * p.Hq + h) * p.L + i0 + i;
        float* ai = &acc[i * Ev];
        if (l[i] != 0.0f) {  // NaN in a kept score makes l NaN: so are the row's output and lse
          const float inv = 1.0f / l[i];
          for (int64_t e = 0; e < Ev; ++e) ai[e] *= inv;
          p.lse[o] = m[i] + std::log(l[i]);
        } else {
          std::fill(ai, ai + Ev, 0.0f);
          p.lse[o] = kNegInf;
        }
        store_row(out + o * Ev, ai, Ev);
      }
    }
  }
}

// Recomputes a tile's dS (the gradient w.r.t. the scaled raw score, already multiplied by
// score_mod'); s holds scale·q·k... on entry (unscaled dot products), dp = dO·Vᵀ.
// On exit s = P (masked: 0), dp = dS_raw. If dbias_row: dbias_row[idx - h*row] += dX.
template <class SM, class MM>
inline void flex_tile_grad(float* s, float* dp, float* raw, int64_t ld, int64_t nq, int64_t nk, int64_t i0, int64_t j0,
                           int b, int h, const FlexParams& p, const float* lse, const float* delta, const SM& sm,
                           const MM& mm, bool partial, float* dbias_row) {
  using namespace flex_detail;
  apply_mods(s, ld, raw, nq, nk, i0, j0, b, h, p.scale, sm, mm, partial);
  for (int64_t i = 0; i < nq; ++i) {
    float* si = s + i * ld;
    float* di = dp + i * ld;
    const float li = lse[i], dl = delta[i];
    if (li == kNegInf) {
      for (int64_t j = 0; j < nk; ++j) si[j] = di[j] = 0.0f;
      continue;
    }
    row_softmax_grad(si, di, nk, li, dl);
    if constexpr (attention::is_learnable_v<SM>) {
      if (dbias_row) {
        const int64_t base = static_cast<int64_t>(h) * p.bias_row;
        for (int64_t j = 0; j < nk; ++j)
          dbias_row[sm.bias_index(b, h, static_cast<int>(i0 + i), static_cast<int>(j0 + j)) - base] += di[j];
      }
    }
    if constexpr (attention::has_capture_grad_v<SM>) {
      if (dbias_row) {
        for (int64_t j = 0; j < nk; ++j) {
          if (si[j] == 0.0f) continue;  // masked (or P underflowed): nothing to add, whatever the mod's slope
          int64_t at = -1;
          const float d =
              sm.capture_grad(raw[i * ld + j], b, h, static_cast<int>(i0 + i), static_cast<int>(j0 + j), &at);
          if (at >= 0) dbias_row[at] += di[j] * d;
        }
      }
    }
    if constexpr (std::is_same_v<SM, attention::NoScoreMod>) {
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) di[j] *= p.scale;
    } else {
      // Only where P > 0: a masked pair's dS is 0 whatever score_mod' says there (0 · NaN was NaN
      // for a mod whose derivative is NaN off the mask), as on the GPU (grad_elem).
      for (int64_t j = 0; j < nk; ++j)
        di[j] = si[j] != 0.0f ? di[j] * p.scale *
                                    sm.dscore(raw[i * ld + j], b, h, static_cast<int>(i0 + i), static_cast<int>(j0 + j))
                              : 0.0f;
    }
  }
}

template <class T, class SM, class MM>
void flex_backward(const FlexParams& p, const SM& sm, const MM& mm) {
  using namespace flex_detail;
  const int64_t QB = p.QB, KB = p.KB, E = p.E, Ev = p.Ev, G = p.Hq / p.Hkv;
  // A tile's rows and columns at most: the scratch tiles' extents and leading dimension (a block
  // larger than the sequence allocates only the sequence).
  const int64_t QT = std::min(QB, p.L), KT = std::min(KB, p.S);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* out = static_cast<const T*>(p.out);
  const T* dout = static_cast<const T*>(p.dout);
  // A learnable table (bias_row floats per head) or a learnable capture (bias_row = its size).
  const bool learn = (attention::is_learnable_v<SM> || attention::has_capture_grad_v<SM>) && p.dbias != nullptr;
  const int64_t rows = p.B * p.Hq * p.L;
  // Δ = rowsum(dO ∘ O) − dlse
#pragma omp parallel for schedule(static) if (rows > 256)
  for (int64_t r = 0; r < rows; ++r) {
    float d = 0.0f;
    if constexpr (std::is_same_v<T, float>)
      d = row_dot(dout + r * Ev, out + r * Ev, Ev);
    else
      for (int64_t e = 0; e < Ev; ++e) d += static_cast<float>(dout[r * Ev + e]) * static_cast<float>(out[r * Ev + e]);
    p.delta[r] = d - (p.dlse ? p.dlse[r] : 0.0f);
  }
  const int64_t qtasks = p.B * p.Hq * p.nQ;
  T* dq = static_cast<T*>(p.dq);
  T* dk = static_cast<T*>(p.dk);
  T* dv = static_cast<T*>(p.dv);
  // One thread's tiles for q_block (a tile's rows QT and columns KT at most).
  struct QScratch {
    std::vector<float> qf, dof, kt, kf, vt, s, dp, raw, acc;
    QScratch(int64_t QT, int64_t KT, int64_t E, int64_t Ev, bool keep_raw)
        : qf(QT * E), dof(QT * Ev), kt(E * KT), kf(KT * E), vt(Ev * KT), s(QT * KT), dp(QT * KT),
          raw(keep_raw ? QT * KT : 0), acc(QT * E) {}
  };
  constexpr bool keep_raw = !std::is_same_v<SM, attention::NoScoreMod>;  // score_mod' needs the raw score
  // Query block qb of (b, h): its dQ rows and the bias partial row of its dQ-pass task, over its kv
  // blocks, partial then full; with dka / dva (dK and dV of the whole sequence of (b, h / G)), each
  // tile's terms of those too, from the same P and dS.
  const auto q_block = [&](QScratch& w, int64_t b, int64_t h, int64_t qb, float* dka, float* dva) {
    const int64_t hk = h / G, i0 = qb * QB, nq = std::min(QB, p.L - i0);
    const int64_t o = (b * p.Hq + h) * p.L + i0;
    for (int64_t i = 0; i < nq; ++i) {
      load_row(&w.qf[i * E], q + b * p.q_st[0] + h * p.q_st[1] + (i0 + i) * p.q_st[2], E);
      load_row(&w.dof[i * Ev], dout + (o + i) * Ev, Ev);
    }
    std::fill(w.acc.begin(), w.acc.end(), 0.0f);
    float* dbias_row = nullptr;
    if (learn) {
      dbias_row = p.dbias_partial + ((b * p.Hq + h) * p.nQ + qb) * p.bias_row;
      std::fill(dbias_row, dbias_row + p.bias_row, 0.0f);
    }
    const int64_t row = Geo{p}.mask_row(b, h) * p.nQ + qb;
    const T* kbase = k + b * p.k_st[0] + hk * p.k_st[1];
    const T* vbase = v + b * p.v_st[0] + hk * p.v_st[1];
    for_each_kv_block(p, row, [&](int64_t j0, int64_t nk, bool partial) {
      load_transposed(w.kt.data(), KT, kbase + j0 * p.k_st[2], p.k_st[2], nk, E);
      load_transposed(w.vt.data(), KT, vbase + j0 * p.v_st[2], p.v_st[2], nk, Ev);
      for (int64_t j = 0; j < nk; ++j) load_row(&w.kf[j * E], kbase + (j0 + j) * p.k_st[2], E);
      tile_abt(w.s.data(), KT, w.qf.data(), nq, E, w.kt.data(), nk);
      tile_abt(w.dp.data(), KT, w.dof.data(), nq, Ev, w.vt.data(), nk);
      flex_tile_grad(w.s.data(), w.dp.data(), w.raw.empty() ? nullptr : w.raw.data(), KT, nq, nk, i0, j0,
                     static_cast<int>(b), static_cast<int>(h), p, p.lse + o, p.delta + o, sm, mm, partial, dbias_row);
      tile_ax(w.acc.data(), E, w.dp.data(), KT, nq, w.kf.data(), nk);
      if (dka) {
        tile_atx(dva + j0 * Ev, Ev, w.s.data(), KT, nq, w.dof.data(), nk);
        tile_atx(dka + j0 * E, E, w.dp.data(), KT, nq, w.qf.data(), nk);
      }
    });
    for (int64_t i = 0; i < nq; ++i) store_row(dq + (o + i) * E, &w.acc[i * E], E);
  };
  // ---- one pass, where there are tasks enough: one task per (b, h_kv) computes each tile's P and
  // dS once for dQ, dK and dV together (the two passes below compute them twice: 7 tile products a
  // tile instead of 5, two exp passes instead of one). Every output sums in the two passes' order
  // (dQ and the bias partials over the row's kv blocks, partial then full; dK and dV over (query
  // head, q block) in increasing order), so the bits do not depend on which form the thread count
  // chose. Its dK/dV accumulators are the whole sequence's (S · (E + Ev) floats a thread), so only
  // below 4 Mi floats.
  const bool one_pass = p.B * p.Hkv >= omp_get_max_threads() && p.S * (E + Ev) <= (int64_t{1} << 22);
  if (one_pass) {
#pragma omp parallel if (p.B * p.Hkv > 1)
    {
      QScratch w(QT, KT, E, Ev, keep_raw);
      std::vector<float> dka(p.S * E), dva(p.S * Ev);
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < p.B * p.Hkv; ++t) {
        const int64_t hk = t % p.Hkv, b = t / p.Hkv;
        std::fill(dka.begin(), dka.end(), 0.0f);
        std::fill(dva.begin(), dva.end(), 0.0f);
        for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
          for (int64_t qb = 0; qb < p.nQ; ++qb) q_block(w, b, h, qb, dka.data(), dva.data());
        const int64_t ob = (b * p.Hkv + hk) * p.S;
        for (int64_t j = 0; j < p.S; ++j) {
          store_row(dk + (ob + j) * E, &dka[j * E], E);
          store_row(dv + (ob + j) * Ev, &dva[j * Ev], Ev);
        }
      }
    }
  } else {  // two passes: dQ per (b, h, q block), then dK/dV per (b, h_kv, kv block)
    // ---- dQ pass ----
#pragma omp parallel if (qtasks > 1)
    {
      QScratch w(QT, KT, E, Ev, keep_raw);
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < qtasks; ++t) q_block(w, t / (p.nQ * p.Hq), (t / p.nQ) % p.Hq, t % p.nQ, nullptr, nullptr);
    }
    // ---- dK/dV pass ----
    const int64_t ktasks = p.B * p.Hkv * p.nKV;
#pragma omp parallel if (ktasks > 1)
    {
      std::vector<float> qf(QT * E), dof(QT * Ev), kt(E * KT), vt(Ev * KT), s(QT * KT), dp(QT * KT),
          raw(keep_raw ? QT * KT : 0), dka(KT * E), dva(KT * Ev);
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < ktasks; ++t) {
        const int64_t kb = t % p.nKV, hk = (t / p.nKV) % p.Hkv, b = t / (p.nKV * p.Hkv);
        const int64_t j0 = kb * KB, nk = std::min(KB, p.S - j0);
        const T* kbase = k + b * p.k_st[0] + hk * p.k_st[1];
        const T* vbase = v + b * p.v_st[0] + hk * p.v_st[1];
        load_transposed(kt.data(), KT, kbase + j0 * p.k_st[2], p.k_st[2], nk, E);
        load_transposed(vt.data(), KT, vbase + j0 * p.v_st[2], p.v_st[2], nk, Ev);
        std::fill(dka.begin(), dka.end(), 0.0f);
        std::fill(dva.begin(), dva.end(), 0.0f);
        for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
          const int64_t col = Geo{p}.mask_row(b, h) * p.nKV + kb;
          // The partial and full q blocks merged in increasing block order: the order the one-pass
          // form adds them in, so both give the same bits where each list is sorted (as
          // create_block_mask builds them; a hand-made layout with unsorted lists gets correct
          // gradients whose bits may depend on which form the thread count chose).
          const auto [pcnt, pidx] = p.q_blocks(col, true);
          const auto [fcnt, fidx] = p.q_blocks(col, false);
          for (int32_t pa = 0, fu = 0; pa < pcnt || fu < fcnt;) {
            const bool partial = fu >= fcnt || (pa < pcnt && pidx[pa] < fidx[fu]);
            const int64_t i0 = static_cast<int64_t>(partial ? pidx[pa++] : fidx[fu++]) * QB;
            const int64_t nq = std::min(QB, p.L - i0);
            const int64_t o = (b * p.Hq + h) * p.L + i0;
            for (int64_t i = 0; i < nq; ++i) {
              load_row(&qf[i * E], q + b * p.q_st[0] + h * p.q_st[1] + (i0 + i) * p.q_st[2], E);
              load_row(&dof[i * Ev], dout + (o + i) * Ev, Ev);
            }
            tile_abt(s.data(), KT, qf.data(), nq, E, kt.data(), nk);
            tile_abt(dp.data(), KT, dof.data(), nq, Ev, vt.data(), nk);
            flex_tile_grad(s.data(), dp.data(), raw.empty() ? nullptr : raw.data(), KT, nq, nk, i0, j0,
                           static_cast<int>(b), static_cast<int>(h), p, p.lse + o, p.delta + o, sm, mm, partial,
                           nullptr);
            tile_atx(dva.data(), Ev, s.data(), KT, nq, dof.data(), nk);
            tile_atx(dka.data(), E, dp.data(), KT, nq, qf.data(), nk);
          }
        }
        const int64_t ob = (b * p.Hkv + hk) * p.S + j0;
        for (int64_t j = 0; j < nk; ++j) {
          store_row(dk + (ob + j) * E, &dka[j * E], E);
          store_row(dv + (ob + j) * Ev, &dva[j * Ev], Ev);
        }
      }
    }
  }
  // ---- learnable capture: reduce the per-task partials over the tasks in order ----
  if constexpr (attention::has_capture_grad_v<SM>) {
    if (learn) {
      const int64_t R = p.bias_row;
#pragma omp parallel for schedule(static) if (R > 4096)
      for (int64_t x = 0; x < R; ++x) {
        float sum = 0.0f;
        for (int64_t t = 0; t < qtasks; ++t) sum += p.dbias_partial[t * R + x];
        p.dbias[x] = sum;
      }
    }
    return;
  }
  // ---- learnable bias: reduce the per-(b, h, q-block) partial rows in a fixed order ----
  if (learn) {
    const int64_t R = p.bias_row;
#pragma omp parallel for schedule(static) if (p.Hq * R > 4096)
    for (int64_t x = 0; x < p.Hq * R; ++x) {
      const int64_t h = x / R, r = x % R;
      float sum = 0.0f;
      for (int64_t b = 0; b < p.B; ++b)
        for (int64_t qb = 0; qb < p.nQ; ++qb) sum += p.dbias_partial[((b * p.Hq + h) * p.nQ + qb) * R + r];
      p.dbias[x] = sum;
    }
  }
}

}  // namespace kiln::kernels::cpu
