// Hopper (sm_90a) building blocks for warp-specialised tensor-core kernels: shared-memory matrix
// descriptors for 128-byte-swizzled tiles, the warpgroup mma (wgmma.mma_async, 16-bit inputs,
// f32 accumulators) with its fences, mbarriers, and the bulk tensor copies (TMA) global → shared
// and shared → global (tensor maps are encoded on the host: tensor_map.h), named barriers, and
// the TMA store of a warpgroup's accumulator rows (store_rows_tma).
// Device-only (no host code): NVRTC compiles it (kernels/device_std.h), given the toolkit's
// include folder for cuda_bf16.h / cuda_fp16.h; there CUtensorMap is declared as cuda.h does.
//
// NOTE [swizzled tiles for wgmma and TMA]
// A tile of ROWS × COLS 16-bit elements (COLS a multiple of 64) is stored as COLS / 64 column
// groups, each ROWS rows of 128 bytes: element (r, c) of group c / 64 at byte
//   (c / 64)·ROWS·128 + r·128 + ((c % 64 / 8) ^ (r % 8))·16 + (c % 8)·2,
// from a 1024-byte-aligned base. This is what a TMA copy with CU_TENSOR_MAP_SWIZZLE_128B and a
// box of 64 columns writes, and it is the canonical "128B swizzle" layout of wgmma in both
// orientations:
// - K-major (the reduction dim along a row: Q and K in S = Q·Kᵀ): 8-row core groups 1024 bytes
//   apart (SBO = 1024; LBO unused); a k16 step moves the start address by 32 bytes inside the
//   128-byte row, and the next 64 columns are the next group (ROWS·128 bytes on).
// - MN-major (the output dim along a row: V in O = P·V, B = V with N = head dim): 64 columns of
//   N per group, groups LBO = ROWS·128 bytes apart; 8-row core groups along K SBO = 1024 apart; a
//   k16 step (16 keys) moves the start address by 16·128 bytes. The mma reads it transposed
//   (imm-trans-b = 1).
//
// NOTE [wgmma fragments] A warpgroup (4 consecutive warps, the first at a warp index divisible
// by 4) computes a 64 × N tile; warp w of the group owns rows 16w .. 16w + 15 and holds them
// exactly like the C fragments of mma.sync m16n8 tiles side by side (mma.cuh): d[j][i] is row
// 16w + g + 8·(i / 2), column 8j + 2t + (i % 2). An A operand from registers is laid out like
// the m16n8k16 A fragment of the warp's 16 rows, so a converted accumulator feeds the next mma
// (FlashAttention's P·V) with no shuffles.
#pragma once
#ifdef __CUDACC_RTC__
typedef struct CUtensorMap_st {  // cuda.h's opaque 128-byte tensor map
  alignas(64) unsigned long long opaque[16];
} CUtensorMap;
#else
#include <cuda.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kiln/kernels/cuda/mma.cuh"
#include "kiln/kernels/device_std.h"

namespace kiln::kernels::cuda::wgmma {

// ---- descriptors ----
// A shared-memory matrix descriptor of a 128-byte-swizzled operand (see the NOTE): start address,
// leading and stride byte offsets, layout type 1 (128B swizzle) in bits 62–63.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

// The byte offset of element (r, c) in a ROWS-row tile of that layout (NOTE [swizzled tiles for
// wgmma and TMA]); c a multiple of 8 gives its 16-byte chunk.
template <int ROWS> __device__ __forceinline__ uint32_t sw128_offset(int r, int c) {
  return (c >> 6) * (ROWS * 128) + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2;
}

// The descriptor of the same operand `bytes` (a multiple of 16) further on: the start address
// is the low word's bits 0–13 in 16-byte units, and shared memory ends below 256 KB, so adding to
// the low word never carries into the offsets above it. One add with a constant instead of the
// mask, shift and merge of desc_sw128 per wgmma (the backward's steps issued ~20 instructions of
// descriptor arithmetic per pair of wgmma).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4), hi = static_cast<uint32_t>(desc >> 32);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// ---- ordering ----
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers across wgmma
// issue / wait points (the asm statements above do not name the registers).
template <int R, int C> __device__ __forceinline__ void fence_operands(float (&d)[R][C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) asm volatile("" : "+f"(d[r][c])::"memory");
}
template <int R, int C> __device__ __forceinline__ void fence_operands(uint32_t (&d)[R][C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) asm volatile("" : "+r"(d[r][c])::"memory");
}

// ---- the mma (one k16 step of a 64 × N tile) ----
// d (+)= A·B with A and B from shared memory, both K-major; scale_d = 0 overwrites d.
template <class T, int N> __device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d);
// d (+)= A·B with A from registers (the warp's m16k16 A fragment) and B from shared memory,
// MN-major (read transposed: kTransB = 1) or K-major (kTransB = 0); scale_d = 0 overwrites d.
// RsMma<T, N> holds the instruction of one type and N (a struct: the transpose stays a template
// parameter of one asm statement).
template <class T, int N> struct RsMma;
template <class T, int N, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  RsMma<T, N>::template run<kTransB>(d, a, desc_b, scale_d);
}

// The instructions for both 16-bit types and N = 64, 128, one body per kind (macros below): the
// accumulator operand lists (d[N / 8][4] as "+f" operands, and their %0 .. placeholders).
#define KILN_WGMMA_D8_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KILN_WGMMA_D16_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define KILN_WGMMA_D8_OUTS "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define KILN_WGMMA_D16_OUTS "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
// One k16 step from shared memory (SS) or with A from registers (RS) for type CT ("PT" in PTX),
// N columns, R = N / 8 accumulator rows; DA, DB, A, DESC, SCALE, TRANS: the placeholders of the
// operands after the accumulators.
#define KILN_WGMMA_SS(CT, PT, N, R, DA, DB, SCALE) \
  template <> \
  __device__ __forceinline__ void wgmma_ss<CT, N>(float (&d)[R][4], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT \
                 "." PT " " KILN_WGMMA_D##R##_REGS ", " DA ", " DB ", p, 1, 1, 0, 0;\n}\n" \
                 : KILN_WGMMA_D##R##_OUTS \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d)); \
  }
#define KILN_WGMMA_RS(CT, PT, N, R, A, DESC, SCALE, TRANS) \
  template <> struct RsMma<CT, N> { \
    template <int kTransB> \
    static __device__ __forceinline__ void run(float (&d)[R][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT \
                   "." PT " " KILN_WGMMA_D##R##_REGS ", " A ", " DESC ", p, 1, 1, " TRANS ";\n}\n" \
                   : KILN_WGMMA_D##R##_OUTS \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB)); \
    } \
  };
#define KILN_WGMMA_INSTRUCTIONS(CT, PT) \
  KILN_WGMMA_SS(CT, PT, 64, 8, "%32", "%33", "%34") \
  KILN_WGMMA_SS(CT, PT, 128, 16, "%64", "%65", "%66") \
  KILN_WGMMA_RS(CT, PT, 64, 8, "{%32, %33, %34, %35}", "%36", "%37", "%38") \
  KILN_WGMMA_RS(CT, PT, 128, 16, "{%64, %65, %66, %67}", "%68", "%69", "%70")
KILN_WGMMA_INSTRUCTIONS(__nv_bfloat16, "bf16")
KILN_WGMMA_INSTRUCTIONS(__half, "f16")
#undef KILN_WGMMA_INSTRUCTIONS
#undef KILN_WGMMA_SS
#undef KILN_WGMMA_RS
#undef KILN_WGMMA_D8_REGS
#undef KILN_WGMMA_D16_REGS
#undef KILN_WGMMA_D8_OUTS
#undef KILN_WGMMA_D16_OUTS

// ---- register reallocation between warpgroups (needs a register cap at kernel entry:
// __launch_bounds__(threads, 1)); every thread of the warpgroup executes it ----
template <int R> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

// ---- mbarriers (shared-memory 64-bit barriers with a phase bit and a transaction count) ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// The first 1024-byte-aligned byte of a dynamic shared buffer (swizzled tiles need it; the
// caller allocates 1023 bytes more). An offset from the array itself, not an integer round
// trip, so the compiler keeps the shared state space and reads through it with LDS.
__device__ __forceinline__ unsigned char* align_1024(unsigned char* smem) {
  return smem + ((1024 - (smem_u32(smem) & 1023)) & 1023);
}
// Each takes the barrier as a shared-memory address (a uint32_t: the hot loops keep their
// addresses as 32-bit offsets from smem_u32 of the buffer, which NVRTC, unlike nvcc, otherwise
// computes in 64 bits and converts at every use), or as a pointer into shared memory.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) { mbar_init(smem_u32(bar), count); }
// Makes barrier initialisation visible to the async proxy (the TMA unit); the CTA syncs after.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { mbar_arrive(smem_u32(bar)); }
// Arrives and announces `bytes` more of transactions (TMA copies completing on this barrier).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  mbar_arrive_expect_tx(smem_u32(bar), bytes);
}
// Waits until the phase of parity `parity` has completed (a fresh barrier counts its phase
// "parity 1" as complete, so a producer's first wait on an empty slot passes at once).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) { mbar_wait(smem_u32(bar), parity); }

// Lane 0 reads a producer's slot in shared memory (`slot`: its 32-bit shared address) and hands the
// value to its warp (all lanes call it). Where one elected lane per warp arrives on the barrier
// that lets the producer rewrite the slot, the only thread that read it is the one whose arrive
// releases the read: an arrive releases the arriving thread's own accesses (compute-sanitizer's
// racecheck checks exactly that, and reported the slots as WAR hazards when every lane read them).
// The load is asm volatile so the compiler cannot turn it into a load by every lane and a select.
__device__ __forceinline__ int32_t warp_read_slot(uint32_t slot) {
  int32_t v = 0;
  if ((threadIdx.x & 31) == 0) asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(slot) : "memory");
  return __shfl_sync(0xffffffffu, v, 0);
}

// ---- TMA: one box of a 4-D tensor map into shared memory, completing on `bar` ----
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  tma_load_4d(smem_u32(dst), map, smem_u32(bar), c0, c1, c2, c3);
}

// ---- TMA: one box of shared memory (the layout a load of the same map writes) → a 4-D tensor ----
// Elements outside the tensor are not written. The copy reads shared memory after the issuing
// thread's bulk_commit, until bulk_wait_read says it is done; shared-memory writes of other
// threads must be made visible to it first (fence_proxy_async by the writers, then a barrier).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed bulk groups still read shared memory.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's shared-memory writes before later async-proxy (TMA, wgmma) accesses.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// A barrier among `threads` threads of the CTA (a multiple of 32) on hardware barrier `id` (1..15;
// 0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- a warpgroup's 64 result rows leave by TMA ----
// Fragment column groups J0 .. J0 + NJ − 1 of `acc` (a 64 × 8·NA accumulator, NOTE [wgmma
// fragments]) rounded to 16 bits into a dead swizzled tile of ROWS rows per 64-column group
// (`tile`: its first byte; the warpgroup's rows start at row 64·wgi), in the layout a TMA load
// writes (NOTE [swizzled tiles for wgmma and TMA]; a quad's four 4-byte stores of a row hit
// distinct banks); then the warpgroup meets at named barrier 1 + wgi and its first thread
// (`issuer`) stores the rows to tensor coordinates (col0 + 64·gi, row0 + 64·wgi, c2, c3) of `map`
// (box 64 × 64) and commits the group; it must bulk_wait_read before the tile is written again.
// (wgi, lane and issuer come from the caller, which has them in registers: deriving them here
// from threadIdx cost the attention forward 8 bytes more of spills.)
template <class T, int NJ, int ROWS, int J0 = 0, int NA>
__device__ __forceinline__ void store_rows_tma(const float (&acc)[NA][4], unsigned char* tile, int wgi, int lane,
                                               bool issuer, const CUtensorMap* map, int row0, int c2, int c3,
                                               int col0 = 0) {
  static_assert(J0 + NJ <= NA && NJ % 8 == 0, "whole 64-column groups of the accumulator");
  const int wq = (threadIdx.x >> 5) & 3, g = lane >> 2, t4 = lane & 3;
  unsigned char* rows = tile + wgi * 64 * 128;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      // sw128_offset<ROWS>(lr, 8j + 2·t4) written out with lr % 8 == g (through the helper's
      // lr & 7 the attention forward's SASS had 8 instructions more)
      const int lr = 16 * wq + g + 8 * hr;  // row within the warpgroup's 64
      *reinterpret_cast<uint32_t*>(rows + (j >> 3) * ROWS * 128 + lr * 128 + (((j & 7) ^ g) << 4) + t4 * 4) =
          ::kiln::kernels::cuda::mma::pack2<T>(acc[J0 + j][2 * hr], acc[J0 + j][2 * hr + 1]);
    }
  fence_proxy_async();
  named_barrier(1 + wgi, 128);
  if (issuer) {
#pragma unroll
    for (int gi = 0; gi < NJ / 8; ++gi) tma_store_4d(map, rows + gi * ROWS * 128, col0 + 64 * gi, row0 + 64 * wgi, c2, c3);
    bulk_commit();
  }
}

}  // namespace kiln::kernels::cuda::wgmma
