// kiln's f32 matrix product on AVX-512 (kernels/cpu/sgemm.h): packing of op(b), the 14 x 32
// register tile, and the loops over K blocks, column blocks and tiles. Compiled for every x86-64
// target with the AVX-512 functions marked target("avx512f"), so the baseline build keeps running
// on older CPUs (own_sgemm_supported() is false there).
#include "kiln/kernels/cpu/sgemm.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/kernels/cpu/isa/isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KILN_AVX512 __attribute__((target("avx512f,fma")))
#endif

namespace kiln::kernels::cpu {

bool own_sgemm_supported() { return isa::cpu_features().avx512f; }  // false off x86-64

#if defined(__x86_64__)
namespace {

constexpr int kMr = 14;               // rows of c per tile (28 accumulators + 2 b vectors + 1 broadcast)
constexpr int kNr = 32;               // columns of c per tile: two 16-float vectors
constexpr int64_t kKcMax = 256;       // K block: a tile's 14 rows of a stay in L1 across the columns
constexpr int64_t kNc = 1024;         // column block: a K block of packed b (≤ 1 MiB) stays in L2

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

// Panel q of op(b)[k0 : k0 + kc, j0 : j0 + nc] into `out`: kc rows of 32 columns, row-major,
// columns past nc zero.
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

// c[0 : R, 0 : cols] = a-tile · b-tile + beta · c, over kc values of k. `a` is op(a)'s element
// (i0, k0): row r, step k at a[r * lda + k] (row-major a, read in place) or a[k * lda + r] (a
// transposed a, packed: lda = kMr). `b` is op(b)'s element (k0, j0), step k's 32 values at b[k * ldb]
// (a packed panel, ldb = kNr, zero-padded; or a row-major b read in place, its columns past `cols`
// masked off).
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

// c[0 : n] = beta · c ⊕ part[0] ⊕ part[1] ⊕ ... (parts K blocks' products, `stride` apart): the
// bits the tiles leave when they add the blocks in turn (the first as fmadd(beta, c, P) or P, each
// later one as fmadd(1, c, P) = c + P).
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

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, float, int);

// tile<R, TransA> for R = 1..kMr, indexed by R - 1 (the last row panel's height).
template <bool TransA, size_t... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::index_sequence<R...>) {
  return {&tile<static_cast<int>(R) + 1, TransA>...};
}
constexpr auto kTilesRowMajorA = tile_table<false>(std::make_index_sequence<kMr>{});
constexpr auto kTilesTransA = tile_table<true>(std::make_index_sequence<kMr>{});

}  // namespace

void own_sgemm(const SgemmProblem& p) {
  KILN_CHECK(own_sgemm_supported(), "own_sgemm: this CPU has no AVX-512F");
  KILN_CHECK(p.m >= 0 && p.n >= 0 && p.k >= 1, "own_sgemm: a product of [", p.m, ", ", p.k, "] by [", p.k, ", ", p.n,
             "] (k must be at least 1)");
  if (p.m == 0 || p.n == 0) return;
  const auto& tiles = p.trans_a ? kTilesTransA : kTilesRowMajorA;
  const int64_t k_blocks = (p.k + kKcMax - 1) / kKcMax, kc_even = (p.k + k_blocks - 1) / k_blocks;
  // Row panels of even height (128 rows: ten of 12-13, not nine of 14 and one of 2): panel mp is
  // rows [first_row(mp), first_row(mp + 1)).
  const int64_t m_panels = (p.m + kMr - 1) / kMr;
  const auto first_row = [&](int64_t mp) { return p.m * mp / m_panels; };
  const int64_t nc_max = std::min(kNc, p.n), panels_max = (nc_max + kNr - 1) / kNr;
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int use = static_cast<int>(std::clamp<int64_t>(p.m * p.n * p.k >> 20, 1, threads));  // ≥ 1 M MACs a thread
  // A weight gradient (a transposed a over the tokens, b row-major over the tokens) split over K:
  // each thread takes whole K blocks, the tokens the elementwise loops' static split wrote on its
  // core, into a part of its own, and the parts are added in block order afterwards, the same
  // bits as one thread adding the blocks in turn. Split by rows, every thread read all the tokens,
  // half of them from the other core's cache (352 x 128 x 1024 in training: 1.5 x its time alone).
  const bool k_split = p.trans_a && !p.trans_b && use > 1 && k_blocks % use == 0 && p.n <= kNc &&
                       p.m * p.n * k_blocks <= (int64_t{1} << 22);
  thread_local std::vector<float> parts_buffer;  // the calling thread's, kept between calls
  if (k_split) parts_buffer.resize(static_cast<size_t>(p.m * p.n * k_blocks));
  float* parts = parts_buffer.data();
#pragma omp parallel num_threads(use) if (use > 1)
  {
    // A transposed b is packed (its columns are rows of b), by every thread for itself: panels
    // packed on one core and read on another crossed between their caches (128 x 128 x 1024 took
    // 195 us on two threads, as long as on one). The thread's buffer is kept between calls (a
    // fresh one cost its page faults each time: a K block of b is up to 1 MiB). A row-major b is
    // read in place.
    thread_local std::vector<float> packed;
    if (p.trans_b) packed.resize(static_cast<size_t>(kc_even * panels_max * kNr));
    float* bp = packed.data();
    // A transposed a's tile rows, copied into one contiguous run (kc steps of kMr values): read in
    // place they are kc cache lines lda apart, which alias in L1 when lda is a multiple of 1024.
    alignas(64) float a_panel[kKcMax * kMr];
    const auto pack_a = [&](int64_t i0, int64_t rows, int64_t k0, int64_t kc) {
      for (int64_t k = 0; k < kc; ++k) std::memcpy(a_panel + k * kMr, p.a + (k0 + k) * p.lda + i0, sizeof(float) * rows);
    };
    if (k_split) {
#pragma omp for schedule(static)
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t k0 = kb * kc_even, kc = std::min(kc_even, p.k - k0);
        float* part = parts + kb * p.m * p.n;
        for (int64_t mp = 0; mp < m_panels; ++mp) {
          const int64_t i0 = first_row(mp), rows = first_row(mp + 1) - i0;
          pack_a(i0, rows, k0, kc);
          for (int64_t q = 0; q * kNr < p.n; ++q) {
            const int cols = static_cast<int>(std::min<int64_t>(kNr, p.n - q * kNr));
            tiles[rows - 1](kc, a_panel, kMr, p.b + k0 * p.ldb + q * kNr, p.ldb, part + i0 * p.n + q * kNr, p.n, 0.0f,
                            cols);
          }
        }
      }
#pragma omp for schedule(static)
      for (int64_t i = 0; i < p.m; ++i) add_parts_row(p.c + i * p.ldc, parts + i * p.n, p.m * p.n, k_blocks, p.n, p.beta);
    } else {
      for (int64_t j0 = 0; j0 < p.n; j0 += kNc) {
        const int64_t nc = std::min(kNc, p.n - j0), n_panels = (nc + kNr - 1) / kNr;
        for (int64_t k0 = 0; k0 < p.k; k0 += kc_even) {
          const int64_t kc = std::min(kc_even, p.k - k0);
          const float beta = k0 == 0 ? p.beta : 1.0f;  // later K blocks add to what the first wrote
          if (p.trans_b)
            for (int64_t q = 0; q < n_panels; ++q) pack_b_panel(p, k0, kc, j0, nc, q, bp);
          // Tiles in row-panel-major order, split into contiguous ranges: a thread keeps its rows of
          // a in L1 across the column panels, and takes the rows the same static split of the
          // elementwise loops wrote on its core (a split by columns read half of a from the other
          // core's cache: slower in the trainer than OpenBLAS).
          int64_t packed_mp = -1;  // the row panel a_panel holds
#pragma omp for schedule(static)
          for (int64_t t = 0; t < m_panels * n_panels; ++t) {
            const int64_t mp = t / n_panels, q = t % n_panels;
            const int64_t i0 = first_row(mp), rows = first_row(mp + 1) - i0;
            const float* at = p.a + i0 * p.lda + k0;
            int64_t lda = p.lda;
            if (p.trans_a) {
              if (mp != packed_mp) {
                pack_a(i0, rows, k0, kc);
                packed_mp = mp;
              }
              at = a_panel;
              lda = kMr;
            }
            const float* bt = p.trans_b ? bp + q * kc * kNr : p.b + k0 * p.ldb + j0 + q * kNr;
            const int64_t ldb = p.trans_b ? kNr : p.ldb;
            const int cols = static_cast<int>(std::min<int64_t>(kNr, nc - q * kNr));
            tiles[rows - 1](kc, at, lda, bt, ldb, p.c + i0 * p.ldc + j0 + q * kNr, p.ldc, beta, cols);
          }
        }
      }
    }
  }
}

#else  // not x86-64: the BLAS does every product

void own_sgemm(const SgemmProblem&) { fail("own_sgemm: kiln's own f32 product is built for x86-64 only"); }

#endif

}  // namespace kiln::kernels::cpu
