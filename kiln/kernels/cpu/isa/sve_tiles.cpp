// SVE versions of the flex attention's tile products (kernels/cpu/attention_impl.h: tile_abt,
// tile_ax, tile_atx). Register blocks of 4 output rows × 2 vectors (2·svcntw() columns), the
// last block of a row under svwhilelt predicates; every output element sums its terms in
// increasing reduction index with one fused multiply-add each (row_dot in sve_math.cpp
// matches that order). Compiled only for aarch64 with -march=armv8-a+sve.
#include "kiln/kernels/cpu/isa/sve_common.h"

#if defined(__ARM_FEATURE_SVE)

namespace kiln::kernels::cpu::isa::sve_impl {

// s[i * ld + j] = sum_e a[i * n + e] * bt[e * ld + j] for i < m, j < nk.
void tile_abt(float* s, int64_t ld, const float* a, int64_t m, int64_t n, const float* bt, int64_t nk) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  int64_t i0 = 0;
  for (; i0 + 4 <= m; i0 += 4) {
    const float *a0 = a + i0 * n, *a1 = a0 + n, *a2 = a1 + n, *a3 = a2 + n;
    for (int64_t j0 = 0; j0 < nk; j0 += 2 * vl) {
      const svbool_t p0 = svwhilelt_b32_s64(j0, nk), p1 = svwhilelt_b32_s64(j0 + vl, nk);
      svfloat32_t c00 = svdup_n_f32(0), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
      for (int64_t e = 0; e < n; ++e) {
        const float* b = bt + e * ld + j0;
        const svfloat32_t b0 = svld1_f32(p0, b), b1 = svld1_f32(p1, b + vl);
        c00 = svmla_n_f32_x(p0, c00, b0, a0[e]), c01 = svmla_n_f32_x(p1, c01, b1, a0[e]);
        c10 = svmla_n_f32_x(p0, c10, b0, a1[e]), c11 = svmla_n_f32_x(p1, c11, b1, a1[e]);
        c20 = svmla_n_f32_x(p0, c20, b0, a2[e]), c21 = svmla_n_f32_x(p1, c21, b1, a2[e]);
        c30 = svmla_n_f32_x(p0, c30, b0, a3[e]), c31 = svmla_n_f32_x(p1, c31, b1, a3[e]);
      }
      float* o = s + i0 * ld + j0;
      svst1_f32(p0, o, c00), svst1_f32(p1, o + vl, c01), o += ld;
      svst1_f32(p0, o, c10), svst1_f32(p1, o + vl, c11), o += ld;
      svst1_f32(p0, o, c20), svst1_f32(p1, o + vl, c21), o += ld;
      svst1_f32(p0, o, c30), svst1_f32(p1, o + vl, c31);
    }
  }
  for (; i0 < m; ++i0) {  // row tail
    const float* ai = a + i0 * n;
    for (int64_t j0 = 0; j0 < nk; j0 += vl) {
      const svbool_t pg = svwhilelt_b32_s64(j0, nk);
      svfloat32_t c = svdup_n_f32(0);
      for (int64_t e = 0; e < n; ++e) c = svmla_n_f32_x(pg, c, svld1_f32(pg, bt + e * ld + j0), ai[e]);
      svst1_f32(pg, s + i0 * ld + j0, c);
    }
  }
}

namespace {

// acc[i * n + :] += sum_k w(i, k) · x[k * n + :] for i < out_rows, k < k_len, with
// w(i, k) = w[i * w_out + k * w_sum].
void tile_wx(float* acc, int64_t n, const float* w, int64_t w_out, int64_t w_sum, int64_t out_rows, const float* x,
             int64_t k_len) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  int64_t r0 = 0;
  for (; r0 + 4 <= out_rows; r0 += 4) {
    const float *w0 = w + r0 * w_out, *w1 = w0 + w_out, *w2 = w1 + w_out, *w3 = w2 + w_out;
    for (int64_t e0 = 0; e0 < n; e0 += 2 * vl) {
      const svbool_t p0 = svwhilelt_b32_s64(e0, n), p1 = svwhilelt_b32_s64(e0 + vl, n);
      float* o = acc + r0 * n + e0;
      svfloat32_t c00 = svld1_f32(p0, o), c01 = svld1_f32(p1, o + vl);
      svfloat32_t c10 = svld1_f32(p0, o + n), c11 = svld1_f32(p1, o + n + vl);
      svfloat32_t c20 = svld1_f32(p0, o + 2 * n), c21 = svld1_f32(p1, o + 2 * n + vl);
      svfloat32_t c30 = svld1_f32(p0, o + 3 * n), c31 = svld1_f32(p1, o + 3 * n + vl);
      for (int64_t k = 0; k < k_len; ++k) {
        const float* xk = x + k * n + e0;
        const svfloat32_t x0 = svld1_f32(p0, xk), x1 = svld1_f32(p1, xk + vl);
        const int64_t wk = k * w_sum;
        c00 = svmla_n_f32_x(p0, c00, x0, w0[wk]), c01 = svmla_n_f32_x(p1, c01, x1, w0[wk]);
        c10 = svmla_n_f32_x(p0, c10, x0, w1[wk]), c11 = svmla_n_f32_x(p1, c11, x1, w1[wk]);
        c20 = svmla_n_f32_x(p0, c20, x0, w2[wk]), c21 = svmla_n_f32_x(p1, c21, x1, w2[wk]);
        c30 = svmla_n_f32_x(p0, c30, x0, w3[wk]), c31 = svmla_n_f32_x(p1, c31, x1, w3[wk]);
      }
      svst1_f32(p0, o, c00), svst1_f32(p1, o + vl, c01);
      svst1_f32(p0, o + n, c10), svst1_f32(p1, o + n + vl, c11);
      svst1_f32(p0, o + 2 * n, c20), svst1_f32(p1, o + 2 * n + vl, c21);
      svst1_f32(p0, o + 3 * n, c30), svst1_f32(p1, o + 3 * n + vl, c31);
    }
  }
  for (; r0 < out_rows; ++r0) {  // row tail
    float* ar = acc + r0 * n;
    const float* wr = w + r0 * w_out;
    for (int64_t e0 = 0; e0 < n; e0 += vl) {
      const svbool_t pg = svwhilelt_b32_s64(e0, n);
      svfloat32_t c = svld1_f32(pg, ar + e0);
      for (int64_t k = 0; k < k_len; ++k) c = svmla_n_f32_x(pg, c, svld1_f32(pg, x + k * n + e0), wr[k * w_sum]);
      svst1_f32(pg, ar + e0, c);
    }
  }
}

}  // namespace

void tile_ax(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols) {
  tile_wx(acc, n, w, ld, 1, rows, x, cols);
}

void tile_atx(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols) {
  tile_wx(acc, n, w, 1, ld, cols, x, rows);
}

}  // namespace kiln::kernels::cpu::isa::sve_impl
#endif
