// CPU FlexAttention's accumulating tile products, tile_ax (dQ += dS·K, O += P·V) and tile_atx
// (dV += Pᵀ·dO, dK += dSᵀ·Q), compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2+FMA) and the
// baseline ISA and picked at load time (target_clones), register-blocked as attention.cpp's tile_abt.
// Apart from attention.cpp because these may contract a·b + c into an FMA (its products may not:
// Δ = rowsum(dO ∘ O) and dP = dO·Vᵀ must round alike to cancel exactly). Nothing here has to
// cancel against another sum, so the AVX2 and AVX-512 clones fuse: one instruction a term instead of a
// multiply and an add. Each output element still sums its terms in increasing reduction index
// (bits fixed per ISA: the baseline clone has no FMA and rounds each product).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#pragma GCC optimize("fp-contract=fast")
#endif
#include <algorithm>
#include <cstdint>

#include "kiln/kernels/cpu/attention_impl.h"
#include "kiln/kernels/cpu/isa/isa.h"  // KILN_SVE_SEAM: the SVE set on aarch64, nothing on x86

namespace kiln::kernels::cpu::flex_detail {

#define KILN_FLEX_CLONES KILN_CPU_CLONES  // kernels/cpu/vec_math.h

// acc[i * n + :] += sum_k w(i, k) · x[k * n + :] for i < out_rows, k < k_len, with
// w(i, k) = w[i * w_out + k * w_sum]: register blocks of kTileRows output rows × kTileCols columns, then the
// column and row tails. Inlined into the two cloned entry points below (one body per target).
[[gnu::always_inline]] inline void tile_wx(float* acc, int64_t n, const float* w, int64_t w_out, int64_t w_sum,
                                           int64_t out_rows, const float* x, int64_t k_len) {
  int64_t r0 = 0;
  for (; r0 + kTileRows <= out_rows; r0 += kTileRows) {
    int64_t e0 = 0;
    for (; e0 + kTileCols <= n; e0 += kTileCols) {
      float c[kTileRows][kTileCols];
      for (int64_t r = 0; r < kTileRows; ++r) std::copy(acc + (r0 + r) * n + e0, acc + (r0 + r) * n + e0 + kTileCols, c[r]);
      for (int64_t k = 0; k < k_len; ++k) {
        const float* xk = x + k * n + e0;
        for (int64_t r = 0; r < kTileRows; ++r) {
          const float wk = w[(r0 + r) * w_out + k * w_sum];
#pragma omp simd
          for (int64_t e = 0; e < kTileCols; ++e) c[r][e] += wk * xk[e];
        }
      }
      for (int64_t r = 0; r < kTileRows; ++r) std::copy(c[r], c[r] + kTileCols, acc + (r0 + r) * n + e0);
    }
    for (int64_t r = r0; r < r0 + kTileRows; ++r)  // column tail
      for (int64_t k = 0; k < k_len; ++k)
        for (int64_t e = e0; e < n; ++e) acc[r * n + e] += w[r * w_out + k * w_sum] * x[k * n + e];
  }
  for (int64_t r = r0; r < out_rows; ++r) {  // row tail
    float* ar = acc + r * n;
    for (int64_t k = 0; k < k_len; ++k) {
      const float wk = w[r * w_out + k * w_sum];
      const float* xk = x + k * n;
#pragma omp simd
      for (int64_t e = 0; e < n; ++e) ar[e] += wk * xk[e];
    }
  }
}

// acc[r * n + :] += sum_c w[r * ld + c] * x[c * n + :] (w indexed by (row, col)).
KILN_FLEX_CLONES void tile_ax(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols) {
  KILN_SVE_SEAM(tile_ax, acc, n, w, ld, rows, x, cols);
  tile_wx(acc, n, w, ld, 1, rows, x, cols);
}

// acc[c * n + :] += sum_r w[r * ld + c] * x[r * n + :] (the transposed product).
KILN_FLEX_CLONES void tile_atx(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols) {
  KILN_SVE_SEAM(tile_atx, acc, n, w, ld, rows, x, cols);
  tile_wx(acc, n, w, 1, ld, cols, x, rows);
}

}  // namespace kiln::kernels::cpu::flex_detail
