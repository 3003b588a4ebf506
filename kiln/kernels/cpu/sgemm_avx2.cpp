// The AVX2 set of kiln's f32 CPU product (kernels/cpu/sgemm_kernels.h), for x86-64 CPUs without
// AVX-512 (AMD Zen 1-3, Intel before Skylake-SP and its client cores): a 6 x 16 register tile (12
// accumulators, 2 vectors of b, 1 broadcast of the 16 ymm registers), the packing of a transposed b
// with in-register 8 x 8 transposes, and the parts' sum. Compiled for every x86-64 target with
// these functions marked target("avx2,fma"); sgemm.cpp uses the set only where the CPU has both.
// Its chains of FMAs are the AVX-512 set's, so both give the same bits.
#include <algorithm>

#include "kiln/kernels/cpu/sgemm_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KILN_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace kiln::kernels::cpu {

#if defined(__x86_64__)
namespace {

constexpr int kMr = 6;   // rows of c per tile
constexpr int kNr = 16;  // columns of c per tile: two 8-float vectors

// The mask of a vector's first n lanes (n clamped to [0, 8]), for maskload / maskstore: lanes off
// the mask are neither read nor written (no fault past the end of a row).
KILN_AVX2 inline __m256i lanes(int64_t n) {
  const int k = static_cast<int>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Transposes the 8 x 8 block in r (r[i] is row i) in place: pairs of rows interleaved, then pairs
// of pairs, then the 128-bit halves exchanged.
KILN_AVX2 void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // r_i0 r_{i+1}0 r_i1 r_{i+1}1 | the same for 4, 5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // columns 2, 3 | 6, 7
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // column 0 of rows i..i+3 | column 4
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // column 1 | 5
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);  // column 2 | 6
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);  // column 3 | 7
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}

// SgemmPackFn: panel q of op(b)[k0 : k0 + kc, j0 : j0 + nc], 16 columns wide: 8 x 8 blocks of b
// (its rows are op(b)'s columns), transposed in registers.
KILN_AVX2 void pack_b_panel(const SgemmProblem& p, int64_t k0, int64_t kc, int64_t j0, int64_t nc, int64_t q,
                            float* out) {
  float* dst = out + q * kc * kNr;
  const int64_t jj = j0 + q * kNr, cols = std::min<int64_t>(kNr, nc - q * kNr);
  for (int half = 0; half < 2; ++half) {
    for (int64_t kb = 0; kb < kc; kb += 8) {
      const int64_t kn = std::min<int64_t>(8, kc - kb);
      const __m256i km = lanes(kn);
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t j = half * 8 + i;
        r[i] = j < cols ? _mm256_maskload_ps(p.b + (jj + j) * p.ldb + k0 + kb, km) : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int64_t t = 0; t < kn; ++t) _mm256_storeu_ps(dst + (kb + t) * kNr + half * 8, r[t]);
    }
  }
}

// SgemmTileFn for R rows of 16 columns. Full tiles read b and c with plain loads; the last panel
// (Full = false) with masked ones, so columns past `cols` are never read or written.
template <int R, bool TransA, bool Full>
KILN_AVX2 void tile_body(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                         float beta, int cols) {
  const __m256i m0 = lanes(cols), m1 = lanes(cols - 8);
  __m256 c0[R], c1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const float* bk = b + k * ldb;
    const __m256 b0 = Full ? _mm256_loadu_ps(bk) : _mm256_maskload_ps(bk, m0);
    const __m256 b1 = Full ? _mm256_loadu_ps(bk + 8) : _mm256_maskload_ps(bk + 8, m1);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(TransA ? a + k * lda + r : a + r * lda + k);
      c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
    }
  }
  // c: plain loads and stores for a full tile's 16 columns (a masked store costs about ten times
  // a plain one on AMD's cores), masked ones for the last panel's.
  const __m256 vb = _mm256_set1_ps(beta);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    if (beta != 0.0f) {  // else c is not read: it may hold anything, NaN included
      c0[r] = _mm256_fmadd_ps(vb, Full ? _mm256_loadu_ps(cr) : _mm256_maskload_ps(cr, m0), c0[r]);
      c1[r] = _mm256_fmadd_ps(vb, Full ? _mm256_loadu_ps(cr + 8) : _mm256_maskload_ps(cr + 8, m1), c1[r]);
    }
    if (Full) {
      _mm256_storeu_ps(cr, c0[r]);
      _mm256_storeu_ps(cr + 8, c1[r]);
    } else {
      _mm256_maskstore_ps(cr, m0, c0[r]);
      _mm256_maskstore_ps(cr + 8, m1, c1[r]);
    }
  }
}

template <int R, bool TransA>
KILN_AVX2 void tile(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                    float beta, int cols) {
  if (cols == kNr)
    tile_body<R, TransA, true>(kc, a, lda, b, ldb, c, ldc, beta, cols);
  else
    tile_body<R, TransA, false>(kc, a, lda, b, ldb, c, ldc, beta, cols);
}

// 8 floats at x: all of them (Full), else the lanes of m.
template <bool Full>
KILN_AVX2 inline __m256 load8(const float* x, __m256i m) {
  return Full ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, m);
}

// Columns [j, j + 8) of add_parts_row, plain loads and stores where Full, else masked to n - j.
template <bool Full>
KILN_AVX2 void add_parts_8(float* c, const float* part, int64_t stride, int64_t parts, int64_t n, float beta,
                           int64_t j) {
  const __m256i m = lanes(n - j);
  __m256 acc = load8<Full>(part + j, m);
  if (beta != 0.0f) acc = _mm256_fmadd_ps(_mm256_set1_ps(beta), load8<Full>(c + j, m), acc);
  for (int64_t b = 1; b < parts; ++b) acc = _mm256_add_ps(acc, load8<Full>(part + b * stride + j, m));
  if (Full)
    _mm256_storeu_ps(c + j, acc);
  else
    _mm256_maskstore_ps(c + j, m, acc);
}

// SgemmAddPartsFn, 8 columns at a time.
KILN_AVX2 void add_parts_row(float* c, const float* part, int64_t stride, int64_t parts, int64_t n, float beta) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) add_parts_8<true>(c, part, stride, parts, n, beta, j);
  if (j < n) add_parts_8<false>(c, part, stride, parts, n, beta, j);
}

}  // namespace

constexpr SgemmKernelSet kSgemmAvx2 = make_kernel_set<kMr>("AVX2", kNr, true, &pack_b_panel, &add_parts_row,
                                                   []<int R, bool TransA>() { return &tile<R, TransA>; });

#endif

}  // namespace kiln::kernels::cpu
