// kiln's Hopper GEMM kernel (sm_90a), device-only: C[b] = epilogue(op(A[b]) · op(B[b])) for
// 16-bit A, B and f32 accumulation, any M, N, K, with the epilogue a functor (epilogue.cuh).
//
// NOTE [kiln sm90 gemm]
// - Tiles of kBM × BN = 128 × 128 or 128 × 256 output elements, K in blocks of kBK = 64. A CTA
//   is three warpgroups: two consumers (rows 0–63 and 64–127 of the tile, a 64 × BN f32
//   accumulator each: BN / 2 registers a thread) and a producer whose first lane issues every
//   TMA copy.
//   setmaxnreg gives the producer's registers to the consumers.
// - The grid is persistent: CTA i takes tiles i, i + gridDim.x, ... (a static schedule: the
//   same for the producer and the consumers, so they need no tile slots), in a grouped order
//   (kGroupM tile rows walk the tile columns together, for L2 reuse of B).
// - kStages (5 for BN = 128, 4 for 256) shared-memory stages of (A block 128 × 64, B block
//   BN × 64), 16 / 2·BN KB, 128-byte
//   swizzled (NOTE [swizzled tiles for wgmma and TMA] in wgmma.cuh). full[s] completes when the
//   copies land (transaction bytes), empty[s] when the 8 consumer warps are done with the stage.
//   The producer runs up to kStages blocks ahead, across tiles too: it loads the next tile's
//   blocks while the consumers run the epilogue.
// - Operands in either orientation: a K-major operand (K contiguous: A = a [M, K]; B = b [N, K],
//   i.e. trans_b) is one TMA box of 64 K-columns × 128 (or BN) rows; an MN-major one (M or N
//   contiguous: A = a [K, M], trans_a; B = b [K, N]) is boxes of 64 M/N-columns × 64 K-rows, and the
//   wgmma reads it transposed (imm-trans = 1, LBO = one group = 64 · 128 bytes, SBO = 1024).
//   A box wholly outside the tensor (M or N tails) is not loaded: its rows of the product are
//   never stored, so stale shared memory there is harmless; partial boxes read zeros beyond the
//   tensor (the K tail: zeros add nothing).
// - Per K block a consumer issues 4 wgmma m64nBNk16 (both operands from shared memory),
//   commits, and waits for the previous block's group (one group in flight), then releases
//   the previous block's stage. After the last block it waits for all and runs the epilogue
//   from the accumulator registers (epilogue.cuh: bounds, bias, residual, row stats; one row
//   statistic per 128 columns whatever BN is), its kind fixed for the tile (NOTE [epilogue kind
//   fixed per tile]). Stored directly (4-byte pairs from the fragments: half of each 32-byte
//   sector a warp's store touches) or, where the launch staged it (a 16-bit out of a kind that
//   stores the tile as computed), through a 128 × 128 swizzled staging tile and a TMA store that
//   the warpgroup does not wait for: it starts the next tile's products while the copy drains,
//   and waits for the copy to have read the staging tile only at the next epilogue.
// Deterministic: fixed partition and order of every sum; no atomics.
#pragma once
#include "kiln/kernels/cuda/wgmma.cuh"

namespace kiln::kernels::cuda::gemm_sm90 {

namespace wg = ::kiln::kernels::cuda::wgmma;

inline constexpr int kBM = 128, kBK = 64;
inline constexpr int kGroupM = 8;
inline constexpr int kThreads = 384;  // 2 consumer warpgroups + the producer warpgroup
inline constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * ((65536 / kThreads) & ~7),
              "the register split must fit the CTA's registers at entry");
inline constexpr int kStatCols = 128;  // columns per row statistic (gemm.h's kTileN)
// Shared memory of a tile kBM × BN: stages of an A block (128 × 64) and a B block (BN × 64).
template <int BN> struct Smem {
  static constexpr int kABytes = kBM * kBK * 2;  // 16 KB
  static constexpr int kBBytes = BN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = BN == 128 ? 5 : 4;
  // The staging tile of a TMA-stored epilogue: 128 rows × 128 columns of 16-bit values (a
  // 256-column tile leaves in two halves), 1024-aligned after the stages.
  static constexpr int kOutOffset = kStages * kStageBytes;
  static constexpr int kOutBytes = kBM * 128 * 2;
  static constexpr int kBarOffset = kOutOffset + kOutBytes;
  static constexpr int kBytes = kBarOffset + 2 * kStages * 8 + 1024;  // + slack to align the base
};
static_assert(Smem<256>::kBytes <= 227 * 1024 && Smem<128>::kBytes <= 227 * 1024, "shared memory per CTA");

// The problem as the kernel sees it (sizes < 2^31: the host checks).
struct Sm90Problem {
  int m, n, k;
  int batch;
  int tiles_m, tiles_n, k_blocks;
  int a_batched, b_batched;  // 0: the operand is broadcast over the batch (TMA batch coordinate 0)
  // Block-sparse A (batch 1; null: dense): a_nonzero[i·nz_sm + j·nz_sk] == 0 says A's rows
  // 64i .. 64i + 63 are zero over K block j (NOTE [skipped K blocks]).
  const unsigned char* a_nonzero;
  long long nz_sm, nz_sk;
};

// NOTE [skipped K blocks]: a tile's K block is skipped (not loaded, no product) when A's two
// 64-row blocks of the tile (one at an M tail) are zero there. The producer and the consumers
// ask the same flags, so they walk the same blocks and the stage ring stays in step; a tile whose
// every block is skipped has a zero accumulator. Skipping a zero block changes no bit of a finite
// product (acc + 0 = acc).
__device__ __forceinline__ bool skip_k_block(const Sm90Problem& p, int m0, int kb) {
  if (p.a_nonzero == nullptr) return false;
  const unsigned char* f = p.a_nonzero + kb * p.nz_sk;
  const long long i = m0 / 64;
  if (f[i * p.nz_sm] != 0) return false;
  return m0 + 64 >= p.m || f[(i + 1) * p.nz_sm] == 0;
}

// One k16 step of a 64 × 128 tile, both operands from shared memory; kTA / kTB = 1 read A / B
// MN-major (transposed). scale_d = 0 overwrites d.

#define KILN_GEMM_D16_REGS                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, " \
  "%25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define KILN_GEMM_D16_OUTS(d)                                                                                          \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),             \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),         \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),         \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),         \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),         \
      "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),       \
      "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]),  \
      "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),  \
      "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]),  \
      "+f"(d[15][3])
#define KILN_GEMM_MMA(CT, PT)                                                                                          \
  template <int kTA, int kTB> struct Mma64x128_##PT {                                                                  \
    static __device__ __forceinline__ void run(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {    \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." #PT      \
                   "." #PT " " KILN_GEMM_D16_REGS ", %64, %65, p, 1, 1, %67, %68;\n}\n"                                  \
                   : KILN_GEMM_D16_OUTS(d)                                                                             \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTA), "n"(kTB));                                      \
    }                                                                                                                  \
  };
KILN_GEMM_MMA(__nv_bfloat16, bf16)
KILN_GEMM_MMA(__half, f16)
#undef KILN_GEMM_MMA
#undef KILN_GEMM_D16_REGS
#undef KILN_GEMM_D16_OUTS

// The same with N = 256 (a 64 × 256 tile: 128 accumulators a thread).
#define KILN_GEMM_D32_REGS \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
  "}"
#define KILN_GEMM_D32_OUTS(d) \
      "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
      "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
      "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
      "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
      "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
      "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
      "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
      "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
      "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), \
      "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
      "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), \
      "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
      "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), \
      "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), \
      "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), \
      "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), \
      "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), \
      "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), \
      "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), \
      "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), \
      "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), \
      "+f"(d[31][2]), "+f"(d[31][3])
template <int kTA, int kTB, bool kBf16> struct Mma64x256 {
  static __device__ __forceinline__ void run(float (&d)[32][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    if constexpr (kBf16) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
                   KILN_GEMM_D32_REGS ", %128, %129, p, 1, 1, %131, %132;\n}\n"
                   : KILN_GEMM_D32_OUTS(d)
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTA), "n"(kTB));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
                   KILN_GEMM_D32_REGS ", %128, %129, p, 1, 1, %131, %132;\n}\n"
                   : KILN_GEMM_D32_OUTS(d)
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTA), "n"(kTB));
    }
  }
};
#undef KILN_GEMM_D32_REGS
#undef KILN_GEMM_D32_OUTS

// One k16 step of a 64 × BN tile (BN = 128 or 256), both operands from shared memory.
template <class T, int BN, int kTA, int kTB>
__device__ __forceinline__ void mma_64xN(float (&d)[BN / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  constexpr bool kBf16 = ::kiln::dev::is_same_v<T, __nv_bfloat16>;
  if constexpr (BN == 256) Mma64x256<kTA, kTB, kBf16>::run(d, desc_a, desc_b, scale_d);
  else if constexpr (kBf16) Mma64x128_bf16<kTA, kTB>::run(d, desc_a, desc_b, scale_d);
  else Mma64x128_f16<kTA, kTB>::run(d, desc_a, desc_b, scale_d);
}

// Tile t of the (batch, tile row, tile column) space in the grouped order.
struct TileCoord {
  int b, m0, n0;
};
template <int BN>
__device__ __forceinline__ TileCoord tile_coord(const Sm90Problem& p, int t) {
  const int per_batch = p.tiles_m * p.tiles_n;
  const int b = t / per_batch, r = t - b * per_batch;
  const int in_group = kGroupM * p.tiles_n;
  const int group = r / in_group, first_m = group * kGroupM;
  const int gsz = min(p.tiles_m - first_m, kGroupM);
  const int q = r - group * in_group;
  const int tm = first_m + q % gsz, tn = q / gsz;
  return {b, tm * kBM, tn * BN};
}

// The epilogue of one consumer warpgroup's 64 × BN accumulator (NOTE [wgmma fragments]: d[j][i]
// is row 16·wq + g + 8·(i/2), column 8j + 2·t4 + i%2 of the warpgroup's 64 × BN), in 128-column
// halves: one row statistic each. kStaged: the values to store replace the accumulators (for
// store_tile_tma); else each element is stored from here.
template <bool kStaged, int BN, class Epi>
__device__ __forceinline__ void tile_epilogue(const Epi& epi, const Sm90Problem& p, const TileCoord& tc,
                                              float (&acc)[BN / 8][4], int wgi, int wq, int g, int t4) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = tc.m0 + 64 * wgi + 16 * wq + g + 8 * hr;
    const bool row_ok = r < p.m;
#pragma unroll
    for (int h = 0; h < BN / kStatCols; ++h) {
      typename Epi::Row row = epi.row_init();
      typename Epi::Addend add[kStatCols / 8];
#pragma unroll
      for (int jj = 0; jj < kStatCols / 8; ++jj) {
        const int c = tc.n0 + 8 * (h * (kStatCols / 8) + jj) + 2 * t4;
        add[jj] = row_ok && c < p.n ? epi.addend(tc.b, r, c, c + 1 < p.n) : typename Epi::Addend{0.f, 0.f};
      }
#pragma unroll
      for (int jj = 0; jj < kStatCols / 8; ++jj) {
        const int j = h * (kStatCols / 8) + jj, c = tc.n0 + 8 * j + 2 * t4;
        if (row_ok && c < p.n) {
          if constexpr (kStaged) {
            const float2 v = epi.value_plus(tc.b, r, c, acc[j][2 * hr], acc[j][2 * hr + 1], c + 1 < p.n, add[jj], row);
            acc[j][2 * hr] = v.x, acc[j][2 * hr + 1] = v.y;
          } else {
            epi.element_plus(tc.b, r, c, acc[j][2 * hr], acc[j][2 * hr + 1], c + 1 < p.n, add[jj], row);
          }
        }
      }
      if constexpr (Epi::kRowStats) {
        if (epi.reduces_rows()) {  // uniform over the CTA
          // The quad (t4 = 0..3) holds the half's 128 columns: merged in a fixed order, the
          // lower lane's state first, so both lanes of a pair compute the same bits.
#pragma unroll
          for (int off = 1; off < 4; off <<= 1) {
            typename Epi::Row other;
            other.a = __shfl_xor_sync(0xffffffffu, row.a, off);
            other.b = __shfl_xor_sync(0xffffffffu, row.b, off);
            row = (t4 & off) ? epi.merge(other, row) : epi.merge(row, other);
          }
          const int c0 = tc.n0 + h * kStatCols;
          if (row_ok && t4 == 0 && c0 < p.n) epi.row_done(tc.b, r, c0 / kStatCols, row);
        }
      }
    }
  }
}

// A warpgroup's 64 × BN values (tile_epilogue<true>) leave by TMA through the staging tile
// (Smem::kOutOffset: 128 columns at a time), once its previous store has read the tile; the
// issuer (the warpgroup's first thread) commits each half's copies. Rows and columns past M and N
// are not written (the TMA clips them).
template <class T, int BN>
__device__ __forceinline__ void store_tile_tma(const float (&acc)[BN / 8][4], unsigned char* staging, int wgi, int lane,
                                               bool issuer, const CUtensorMap* map_c, const TileCoord& tc) {
  if (issuer) wg::bulk_wait_read<0>();
  wg::named_barrier(1 + wgi, 128);
  wg::store_rows_tma<T, 16, kBM, 0>(acc, staging, wgi, lane, issuer, map_c, tc.m0, 0, tc.b, tc.n0);
  if constexpr (BN == 256) {
    if (issuer) wg::bulk_wait_read<0>();
    wg::named_barrier(1 + wgi, 128);
    wg::store_rows_tma<T, 16, kBM, 16>(acc, staging, wgi, lane, issuer, map_c, tc.m0, 0, tc.b, tc.n0 + 128);
  }
}

// The epilogue functor interface (epilogue.cuh's RtEpilogue implements it):
//   struct Row;                                        per-row running state
//   Row row_init() const;
//   struct Addend;  Addend addend(int b, int r, int c, bool ok1) const;
//       the values read from memory for (r, c), (r, c + 1) (bias, residual): the kernel reads a
//       row's addends first, then stores, so that the loads overlap
//   void element_plus(int b, int r, int c, float v0, float v1, bool ok1, Addend add, Row& row) const;
//       v0, v1 = the accumulator at (r, c), (r, c + 1), c even; r < M and c < N are checked
//       by the kernel, ok1 says whether c + 1 < N
//   Row merge(Row lo, Row hi) const;                   two lanes' states (shuffled as floats a, b)
//   bool reduces_rows() const;                         whether this launch reduces rows
//   void row_done(int b, int r, int tn, Row row) const;  once per valid row and tile column
//   bool kRowStats (constexpr): whether the functor can reduce rows at all
//   void with_fixed_kind(F f) const;                   f(a functor whose kind is a constant), once a tile
//   bool kStageable (constexpr); bool staged() const;  whether the kind's tile may leave by TMA, and
//       whether this launch does (then float2 value_plus(b, r, c, v0, v1, ok1, Addend, Row&) gives
//       the values to store, which the kernel rounds to T)
template <class T, int BN, bool kAKMajor, bool kBKMajor, class Epi>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_c, Sm90Problem p, Epi epi) {
  // The operands' majorness is kAKMajor / kBKMajor: a template parameter once named kBK hid this
  // constant in here (no wgmma issued, wrong transaction bytes: an illegal instruction on the H200).
  static_assert(kBK == 64, "K blocks of 64: the TMA boxes, the transaction bytes and the k16 loop assume it");
  using S = Smem<BN>;
  constexpr int kStages = S::kStages;
  constexpr int kBGroups = BN / 64;  // 64-column groups of an MN-major B block
  extern __shared__ unsigned char gemm_smem_raw[];
  unsigned char* smem = wg::align_1024(gemm_smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kBarOffset);
  uint64_t* empty = full + kStages;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) wg::mbar_init(full + s, 1), wg::mbar_init(empty + s, 8);
    wg::mbar_init_fence();
  }
  __syncthreads();
  const int n_tiles = p.batch * p.tiles_m * p.tiles_n;

  if (warp >= 8) {
    // ---- producer: lane 0 of warp 8 issues every copy ----
    wg::setmaxnreg_dec<kProducerRegs>();
    if (warp != 8 || lane != 0) return;
    uint32_t it = 0;
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
      const TileCoord tc = tile_coord<BN>(p, t);
      const int ba = tc.b * p.a_batched, bb = tc.b * p.b_batched;
      // Boxes wholly past M or N are skipped (NOTE): the 64-wide groups that count.
      const int a_groups = kAKMajor ? 2 : (tc.m0 + 64 < p.m ? 2 : 1);
      const int b_groups = kBKMajor ? kBGroups : min(kBGroups, (p.n - tc.n0 + 63) / 64);
      const uint32_t bytes = static_cast<uint32_t>((a_groups + b_groups) * (64 * kBK * 2));
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        if (skip_k_block(p, tc.m0, kb)) continue;  // NOTE [skipped K blocks]
        const uint32_t stage = it % kStages, phase = (it / kStages) & 1;
        ++it;
        wg::mbar_wait(empty + stage, phase ^ 1);
        wg::mbar_arrive_expect_tx(full + stage, bytes);
        unsigned char* sa = smem + stage * S::kStageBytes;
        unsigned char* sb = sa + S::kABytes;
        const int k0 = kb * kBK;
        if (kAKMajor) {
          wg::tma_load_4d(sa, &map_a, full + stage, k0, tc.m0, 0, ba);
        } else {
          for (int g = 0; g < a_groups; ++g) wg::tma_load_4d(sa + g * 64 * 128, &map_a, full + stage, tc.m0 + 64 * g, k0, 0, ba);
        }
        if (kBKMajor) {
          wg::tma_load_4d(sb, &map_b, full + stage, k0, tc.n0, 0, bb);
        } else {
          for (int g = 0; g < b_groups; ++g) wg::tma_load_4d(sb + g * 64 * 128, &map_b, full + stage, tc.n0 + 64 * g, k0, 0, bb);
        }
      }
    }
    return;
  }

  // ---- consumers: warpgroup wgi owns rows 64·wgi .. 64·wgi + 63 of each tile ----
  wg::setmaxnreg_inc<kConsumerRegs>();
  const int wgi = warp >> 2, wq = warp & 3, g = lane >> 2, t4 = lane & 3;
  const bool issuer = wq == 0 && lane == 0;  // the warpgroup's first thread: its TMA stores
  const uint32_t smem_base = wg::smem_u32(smem);
  // Both orientations put warpgroup wgi's A rows at byte 64·128·wgi of the A block: K-major
  // rows 64·wgi.. (128 bytes each), MN-major the second 64-column group.
  constexpr uint32_t kLboA = kAKMajor ? 16 : 64 * 128, kLboB = kBKMajor ? 16 : 64 * 128;
  constexpr uint32_t kStepA = kAKMajor ? 32 : 16 * 128, kStepB = kBKMajor ? 32 : 16 * 128;  // bytes per k16 step
  constexpr int kNJ = BN / 8;  // accumulator column groups of 8
  float acc[kNJ][4];
  uint32_t it = 0;
  for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    const TileCoord tc = tile_coord<BN>(p, t);
    uint32_t prev_stage = 0;
    bool first = true;  // no block multiplied yet: the next product overwrites the accumulator
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      if (skip_k_block(p, tc.m0, kb)) continue;  // NOTE [skipped K blocks]
      const uint32_t stage = it % kStages, phase = (it / kStages) & 1;
      ++it;
      wg::mbar_wait(full + stage, phase);
      const uint32_t sa = smem_base + stage * S::kStageBytes, sb = sa + S::kABytes;
      const uint64_t da = wg::desc_sw128(sa + wgi * 64 * 128, kLboA, 1024);
      const uint64_t db = wg::desc_sw128(sb, kLboB, 1024);
      wg::fence_operands(acc);
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        mma_64xN<T, BN, kAKMajor ? 0 : 1, kBKMajor ? 0 : 1>(acc, wg::desc_advance(da, kk * kStepA),
                                                 wg::desc_advance(db, kk * kStepB), (!first || kk > 0) ? 1 : 0);
      wg::commit();
      wg::wait<1>();
      wg::fence_operands(acc);
      if (!first && lane == 0) wg::mbar_arrive(empty + prev_stage);
      prev_stage = stage;
      first = false;
    }
    wg::wait<0>();
    wg::fence_operands(acc);
    if (first) {  // every K block skipped: the product is zero
#pragma unroll
      for (int j = 0; j < kNJ; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[j][q] = 0.f;
    } else if (lane == 0) {
      wg::mbar_arrive(empty + prev_stage);
    }

    // ---- epilogue from registers, its kind fixed for the tile (NOTE [epilogue kind fixed per tile]),
    // stored by TMA through the staging tile where the launch says so ----
    epi.with_fixed_kind([&](auto e) {
      if constexpr (decltype(e)::kStageable) {
        if (e.staged()) {
          tile_epilogue<true, BN>(e, p, tc, acc, wgi, wq, g, t4);
          store_tile_tma<T, BN>(acc, smem + S::kOutOffset, wgi, lane, issuer, &map_c, tc);
          return;
        }
      }
      tile_epilogue<false, BN>(e, p, tc, acc, wgi, wq, g, t4);
    });
  }
  if (issuer) wg::bulk_wait_read<0>();  // the last store has read the staging tile before the CTA ends
}

}  // namespace kiln::kernels::cuda::gemm_sm90
