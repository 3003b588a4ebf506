// The per-ISA pieces of kiln's own f32 CPU product (kernels/cpu/sgemm.h): a register tile of c for
// each row count 1..mr and both layouts of a, the packing of a transposed b into nr-column panels,
// and the sum of a K-split product's parts. sgemm.cpp's loops (K blocks, column blocks, row panels,
// threads) call them through this table; sgemm_avx512.cpp (14 x 32 tiles) and sgemm_avx2.cpp
// (6 x 16) fill it, each compiled with its instructions marked per function (target attributes),
// so the baseline build keeps running on CPUs without them.
//
// Every set computes each element of c as one chain of FMAs over a K block, from zero, in k order,
// stored as fmadd(beta, c, chain) (or the chain alone where beta is 0), and adds later blocks or a
// K split's parts in block order: the same operations whatever the tile's width, so both sets give
// the same bits (OwnSgemm.BitsDoNotDependOnThreadsRunOrSet).
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>

#include "kiln/kernels/cpu/sgemm.h"

namespace kiln::kernels::cpu {

constexpr int kSgemmMaxMr = 14;          // the tallest tile of any set
constexpr int64_t kSgemmKcMax = 256;     // K block: a tile's rows of a stay in L1 across the columns
constexpr int64_t kSgemmNc = 1024;       // column block: a K block of packed b (≤ 1 MiB) stays in L2

// c[0 : R, 0 : cols] = a-tile · b-tile + beta · c, over kc values of k (R the table index + 1).
// `a` is op(a)'s element (i0, k0): row r, step k at a[r * lda + k] (row-major a, read in place) or
// a[k * lda + r] (a transposed a, packed: lda = mr). `b` is op(b)'s element (k0, j0), step k's nr
// values at b[k * ldb] (a packed panel, ldb = nr, zero-padded; or a row-major b read in place, its
// columns past `cols` never read). beta == 0 never reads c.
using SgemmTileFn = void (*)(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                             int64_t ldc, float beta, int cols);
// Panel q of op(b)[k0 : k0 + kc, j0 : j0 + nc] (b transposed: column j of op(b) is row j of b) into
// out + q · kc · nr: kc rows of nr columns, row-major, columns past nc zero.
using SgemmPackFn = void (*)(const SgemmProblem& p, int64_t k0, int64_t kc, int64_t j0, int64_t nc, int64_t q,
                             float* out);
// c[0 : n] = beta · c ⊕ part[0] ⊕ part[1] ⊕ ... (`parts` K blocks' products, `stride` apart): the
// bits the tiles leave when they add the blocks in turn (the first as fmadd(beta, c, P) or P, each
// later one as c + P).
using SgemmAddPartsFn = void (*)(float* c, const float* part, int64_t stride, int64_t parts, int64_t n, float beta);

struct SgemmKernelSet {
  const char* name;  // "AVX-512", "AVX2"
  int mr, nr;        // the full tile: rows of c, columns of c
  // Whether a row-major b is copied into panels too (sgemm.cpp), not read in place: a tile then
  // streams its K block of b from one contiguous run (the AVX2 set: NN 1024 x 128 x 352 0.95 ->
  // 1.03 x OpenBLAS on one Zen 3 core; the AVX-512 set was measured reading it in place).
  bool pack_row_major_b;
  SgemmTileFn tiles_row_major_a[kSgemmMaxMr];  // index R - 1
  SgemmTileFn tiles_trans_a[kSgemmMaxMr];
  SgemmPackFn pack_b_panel;
  SgemmAddPartsFn add_parts_row;
};

// A set whose tile tables hold, at R - 1, tile_of.template operator()<R, TransA>() (a generic
// lambda naming the file's tile template) for R = 1..Mr.
template <int Mr, class TileOf>
constexpr SgemmKernelSet make_kernel_set(const char* name, int nr, bool pack_row_major_b, SgemmPackFn pack_b_panel,
                                         SgemmAddPartsFn add_parts_row, TileOf tile_of) {
  static_assert(Mr <= kSgemmMaxMr);
  SgemmKernelSet ks{name, Mr, nr, pack_row_major_b, {}, {}, pack_b_panel, add_parts_row};
  [&]<size_t... R>(std::index_sequence<R...>) {
    ((ks.tiles_row_major_a[R] = tile_of.template operator()<static_cast<int>(R) + 1, false>()), ...);
    ((ks.tiles_trans_a[R] = tile_of.template operator()<static_cast<int>(R) + 1, true>()), ...);
  }(std::make_index_sequence<Mr>{});
  return ks;
}

#if defined(__x86_64__)
// The sets of this x86-64 build (sgemm_avx512.cpp, sgemm_avx2.cpp); whether the CPU runs one is
// sgemm.cpp's test. Other targets have none: the BLAS does every product there.
extern const SgemmKernelSet kSgemmAvx512, kSgemmAvx2;
#endif

}  // namespace kiln::kernels::cpu
