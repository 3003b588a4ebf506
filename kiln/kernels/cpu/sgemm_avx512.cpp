// The AVX-512 set of kiln's f32 CPU product (kernels/cpu/sgemm_kernels.h): the 14 x 32 register
// tile, the packing of a transposed b with in-register 16 x 16 transposes, and the parts' sum.
// Compiled for every x86-64 target with these functions marked target("avx512f,fma"), so the
// baseline build keeps running on older CPUs (sgemm.cpp uses the set only where the CPU has it).
#include <algorithm>

#include "kiln/kernels/cpu/sgemm_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KILN_AVX512 __attribute__((target("avx512f,fma")))
#endif

namespace kiln::kernels::cpu {

#if defined(__x86_64__)
namespace {

constexpr int kMr = 14;  // rows of c per tile (28 accumulators + 2 b vectors + 1 broadcast)
constexpr int kNr = 32;  // columns of c per tile: two 16-float vectors

// transpose16 transposes the 16 x 16 block in r (r[i] is row i) in place: transposing swaps each
// bit of the row index with the same bit of the column index, one stage a bit, each an exchange
// between rows i and i + d (i & d == 0) of the lanes whose bit d differs.
// Lane indices of stage d's two permutes (d = 8, 4, 2, 1): row i keeps its lanes with bit d clear
// and takes row i + d's below them; row i + d takes row i's lanes above and keeps its own.
struct TransposeStage {
  alignas(64) int lo[16];
  alignas(64) int hi[16];
};
constexpr TransposeStage transpose_stage(int d) {
  TransposeStage s{};
  for (int j = 0; j < 16; ++j) {
    s.lo[j] = (j & d) ? 16 + j - d : j;
    s.hi[j] = (j & d) ? 16 + j : j + d;
  }
  return s;
}
constexpr TransposeStage kTransposeStages[4] = {transpose_stage(8), transpose_stage(4), transpose_stage(2),
                                                transpose_stage(1)};

KILN_AVX512 void transpose16(__m512 r[16]) {
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
    const int d = 8 >> s;
    const __m512i vlo = _mm512_load_si512(kTransposeStages[s].lo), vhi = _mm512_load_si512(kTransposeStages[s].hi);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i & d) continue;
      const __m512 a = r[i], b = r[i + d];
      r[i] = _mm512_permutex2var_ps(a, vlo, b);
      r[i + d] = _mm512_permutex2var_ps(a, vhi, b);
    }
  }
}

// The mask of a vector's first n lanes (n clamped to [0, 16]).
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// SgemmPackFn: panel q of op(b)[k0 : k0 + kc, j0 : j0 + nc], 32 columns wide.
KILN_AVX512 void pack_b_panel(const SgemmProblem& p, int64_t k0, int64_t kc, int64_t j0, int64_t nc, int64_t q,
                              float* out) {
  float* dst = out + q * kc * kNr;
  const int64_t jj = j0 + q * kNr, cols = std::min<int64_t>(kNr, nc - q * kNr);
  // Column j of op(b) is row j of b: 16 x 16 blocks of b, transposed in registers.
  for (int half = 0; half < 2; ++half) {
    for (int64_t kb = 0; kb < kc; kb += 16) {
      const int64_t kn = std::min<int64_t>(16, kc - kb);
      const __mmask16 km = lanes(kn);
      __m512 r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const int64_t j = half * 16 + i;
        r[i] = j < cols ? _mm512_maskz_loadu_ps(km, p.b + (jj + j) * p.ldb + k0 + kb) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int64_t t = 0; t < kn; ++t) _mm512_storeu_ps(dst + (kb + t) * kNr + half * 16, r[t]);
    }
  }
}

// SgemmTileFn for R rows of 32 columns (a row-major b's columns past `cols` masked off).
template <int R, bool TransA>
KILN_AVX512 void tile(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                      float beta, int cols) {
  const __mmask16 m0 = lanes(cols), m1 = lanes(cols - 16);
  __m512 c0[R], c1[R];
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, b + k * ldb), b1 = _mm512_maskz_loadu_ps(m1, b + k * ldb + 16);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(TransA ? a[k * lda + r] : a[r * lda + k]);
      c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
    }
  }
  const __m512 vb = _mm512_set1_ps(beta);
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    if (beta == 0.0f) {  // c is not read: it may hold anything, NaN included
      _mm512_mask_storeu_ps(cr, m0, c0[r]);
      _mm512_mask_storeu_ps(cr + 16, m1, c1[r]);
    } else {
      _mm512_mask_storeu_ps(cr, m0, _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, cr), c0[r]));
      _mm512_mask_storeu_ps(cr + 16, m1, _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, cr + 16), c1[r]));
    }
  }
}

// SgemmAddPartsFn, 16 columns at a time.
KILN_AVX512 void add_parts_row(float* c, const float* part, int64_t stride, int64_t parts, int64_t n, float beta) {
  const __m512 vb = _mm512_set1_ps(beta);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    __m512 acc = _mm512_maskz_loadu_ps(m, part + j);
    if (beta != 0.0f) acc = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, c + j), acc);
    for (int64_t b = 1; b < parts; ++b) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, part + b * stride + j));
    _mm512_mask_storeu_ps(c + j, m, acc);
  }
}

}  // namespace

constexpr SgemmKernelSet kSgemmAvx512 = make_kernel_set<kMr>("AVX-512", kNr, false, &pack_b_panel, &add_parts_row,
                                                   []<int R, bool TransA>() { return &tile<R, TransA>; });

#endif

}  // namespace kiln::kernels::cpu
