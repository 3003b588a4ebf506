// kiln's own f32 CPU product (kernels/cpu/sgemm.h): the choice of instruction set and the loops
// over K blocks, column blocks, row panels and threads, calling the chosen set's tiles and packing
// (kernels/cpu/sgemm_kernels.h). Plain C++: the instructions of a set live in its own file.
#include "kiln/kernels/cpu/sgemm.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/kernels/cpu/isa/isa.h"
#include "kiln/kernels/cpu/sgemm_kernels.h"

namespace kiln::kernels::cpu {

namespace {

// The set for `isa` where this build has it and the CPU runs it, else null.
const SgemmKernelSet* kernel_set(SgemmIsa isa) {
#if defined(__x86_64__)
  const auto& f = isa::cpu_features();
  const SgemmKernelSet* avx512 = f.avx512f ? &kSgemmAvx512 : nullptr;
  const SgemmKernelSet* avx2 = f.avx2 && f.fma ? &kSgemmAvx2 : nullptr;
#else
  const SgemmKernelSet *avx512 = nullptr, *avx2 = nullptr;
#endif
  switch (isa) {
    case SgemmIsa::avx512: return avx512;
    case SgemmIsa::avx2: return avx2;
    case SgemmIsa::best: return avx512 ? avx512 : avx2;
  }
  return nullptr;
}

const char* isa_name(SgemmIsa isa) {
  switch (isa) {
    case SgemmIsa::avx512: return "AVX-512F";
    case SgemmIsa::avx2: return "AVX2 and FMA";
    case SgemmIsa::best: break;
  }
  return "AVX-512F or AVX2 and FMA";
}

// count rows of N floats from src (rows ld_src apart) to dst (rows ld_dst apart): a copy of a
// size known here, a few moves a row (a memcpy of a run-time size was a library call a row: 0.6 ms
// of a 1.3 ms 352 x 128 x 1024 product, packing 6-row panels of a transposed a).
template <int N>
void copy_rows(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t count) {
  for (int64_t k = 0; k < count; ++k) std::memcpy(dst + k * ld_dst, src + k * ld_src, sizeof(float) * N);
}
using CopyRowsFn = void (*)(float*, int64_t, const float*, int64_t, int64_t);
constexpr int kMaxCopy = 32;  // the widest row copied: a tile's rows (≤ 14) or a panel's columns (≤ 32)
static_assert(kSgemmMaxMr <= kMaxCopy);
constexpr auto kCopyRows = []<size_t... N>(std::index_sequence<N...>) {
  return std::array<CopyRowsFn, kMaxCopy>{&copy_rows<static_cast<int>(N) + 1>...};
}(std::make_index_sequence<kMaxCopy>{});

// Panel q of a row-major op(b)[k0 : k0 + kc, j0 : j0 + nc] into out + q · kc · nr: kc rows of nr
// columns, columns past nc zero (what SgemmPackFn gives for a transposed b).
void pack_b_rows(const SgemmProblem& p, int64_t k0, int64_t kc, int64_t j0, int64_t nc, int64_t q, int64_t nr,
                 float* out) {
  float* dst = out + q * kc * nr;
  const int64_t cols = std::min(nr, nc - q * nr);
  if (cols < nr) std::memset(dst, 0, sizeof(float) * static_cast<size_t>(kc * nr));
  kCopyRows[cols - 1](dst, nr, p.b + k0 * p.ldb + j0 + q * nr, p.ldb, kc);
}

}  // namespace

bool own_sgemm_supported(SgemmIsa isa) { return kernel_set(isa) != nullptr; }

const char* own_sgemm_isa_name(SgemmIsa isa) {
  const SgemmKernelSet* ks = kernel_set(isa);
  return ks ? ks->name : "none";
}

void own_sgemm(const SgemmProblem& p, SgemmIsa isa) {
  const SgemmKernelSet* ks = kernel_set(isa);
  KILN_CHECK(ks != nullptr, "own_sgemm: kiln's f32 product needs an x86-64 CPU with ", isa_name(isa),
             "; this one has none");
  KILN_CHECK(p.m >= 0 && p.n >= 0 && p.k >= 1, "own_sgemm: a product of [", p.m, ", ", p.k, "] by [", p.k, ", ", p.n,
             "] (k must be at least 1)");
  if (p.m == 0 || p.n == 0) return;
  const int64_t mr = ks->mr, nr = ks->nr;
  const auto& tiles = p.trans_a ? ks->tiles_trans_a : ks->tiles_row_major_a;
  const int64_t k_blocks = (p.k + kSgemmKcMax - 1) / kSgemmKcMax, kc_even = (p.k + k_blocks - 1) / k_blocks;
  // Row panels of even height (128 rows on 14-row tiles: ten of 12-13, not nine of 14 and one of
  // 2): panel mp is rows [first_row(mp), first_row(mp + 1)).
  const int64_t m_panels = (p.m + mr - 1) / mr;
  const auto first_row = [&](int64_t mp) { return p.m * mp / m_panels; };
  const int64_t nc_max = std::min(kSgemmNc, p.n), panels_max = (nc_max + nr - 1) / nr;
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int use = static_cast<int>(std::clamp<int64_t>(p.m * p.n * p.k >> 20, 1, threads));  // ≥ 1 M MACs a thread
  // A weight gradient (a transposed a over the tokens, b row-major over the tokens) split over K:
  // each thread takes whole K blocks, the tokens the elementwise loops' static split wrote on its
  // core, into a part of its own, and the parts are added in block order afterwards, the same
  // bits as one thread adding the blocks in turn. Split by rows, every thread read all the tokens,
  // half of them from the other core's cache (352 x 128 x 1024 in training: 1.5 x its time alone).
  const bool k_split = p.trans_a && !p.trans_b && use > 1 && k_blocks % use == 0 && p.n <= kSgemmNc &&
                       p.m * p.n * k_blocks <= (int64_t{1} << 22);
  // b in panels: a transposed b always (its columns are rows of b), a row-major one where the set asks.
  const bool pack_b = p.trans_b || ks->pack_row_major_b;
  const auto pack_b_panel = [&](int64_t k0, int64_t kc, int64_t j0, int64_t nc, int64_t q, float* out) {
    if (p.trans_b)
      ks->pack_b_panel(p, k0, kc, j0, nc, q, out);
    else
      pack_b_rows(p, k0, kc, j0, nc, q, nr, out);
  };
  thread_local std::vector<float> parts_buffer;  // the calling thread's, kept between calls
  if (k_split) parts_buffer.resize(static_cast<size_t>(p.m * p.n * k_blocks));
  float* parts = parts_buffer.data();
#pragma omp parallel num_threads(use) if (use > 1)
  {
    // b's panels are packed by every thread for itself: panels packed on one core and read on
    // another crossed between their caches (128 x 128 x 1024 took 195 us on two threads, as long as
    // on one). The thread's buffer is kept between calls (a fresh one cost its page faults each
    // time: a K block of b is up to 1 MiB). Unpacked, a row-major b is read in place.
    thread_local std::vector<float> packed;
    if (pack_b) packed.resize(static_cast<size_t>(kc_even * panels_max * nr));
    float* bp = packed.data();
    // A transposed a's tile rows, copied into one contiguous run (kc steps of mr values): read in
    // place they are kc cache lines lda apart, which alias in L1 when lda is a multiple of 1024.
    alignas(64) float a_panel[kSgemmKcMax * kSgemmMaxMr];
    const auto pack_a = [&](int64_t i0, int64_t rows, int64_t k0, int64_t kc) {
      kCopyRows[rows - 1](a_panel, mr, p.a + k0 * p.lda + i0, p.lda, kc);
    };
    if (k_split) {
#pragma omp for schedule(static)
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t k0 = kb * kc_even, kc = std::min(kc_even, p.k - k0);
        float* part = parts + kb * p.m * p.n;
        const int64_t n_panels = (p.n + nr - 1) / nr;
        if (pack_b)
          for (int64_t q = 0; q < n_panels; ++q) pack_b_panel(k0, kc, 0, p.n, q, bp);
        for (int64_t mp = 0; mp < m_panels; ++mp) {
          const int64_t i0 = first_row(mp), rows = first_row(mp + 1) - i0;
          pack_a(i0, rows, k0, kc);
          for (int64_t q = 0; q < n_panels; ++q) {
            const float* bt = pack_b ? bp + q * kc * nr : p.b + k0 * p.ldb + q * nr;
            const int cols = static_cast<int>(std::min<int64_t>(nr, p.n - q * nr));
            tiles[rows - 1](kc, a_panel, mr, bt, pack_b ? nr : p.ldb, part + i0 * p.n + q * nr, p.n, 0.0f, cols);
          }
        }
      }
#pragma omp for schedule(static)
      for (int64_t i = 0; i < p.m; ++i)
        ks->add_parts_row(p.c + i * p.ldc, parts + i * p.n, p.m * p.n, k_blocks, p.n, p.beta);
    } else {
      for (int64_t j0 = 0; j0 < p.n; j0 += kSgemmNc) {
        const int64_t nc = std::min(kSgemmNc, p.n - j0), n_panels = (nc + nr - 1) / nr;
        for (int64_t k0 = 0; k0 < p.k; k0 += kc_even) {
          const int64_t kc = std::min(kc_even, p.k - k0);
          const float beta = k0 == 0 ? p.beta : 1.0f;  // later K blocks add to what the first wrote
          if (pack_b)
            for (int64_t q = 0; q < n_panels; ++q) pack_b_panel(k0, kc, j0, nc, q, bp);
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
              lda = mr;
            }
            const float* bt = pack_b ? bp + q * kc * nr : p.b + k0 * p.ldb + j0 + q * nr;
            const int64_t ldb = pack_b ? nr : p.ldb;
            const int cols = static_cast<int>(std::min<int64_t>(nr, nc - q * nr));
            tiles[rows - 1](kc, at, lda, bt, ldb, p.c + i0 * p.ldc + j0 + q * nr, p.ldc, beta, cols);
          }
        }
      }
    }
  }
}

}  // namespace kiln::kernels::cpu
