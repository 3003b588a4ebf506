// Warp-level tensor-core building blocks for sm_80+ kernels (used by the FlexAttention kernels):
// the m16n8k16 16-bit mma with f32 accumulation, ldmatrix loads from shared memory, cp.async
// copies global → shared with zero fill, an XOR swizzle for conflict-free 16-byte chunks, and
// packing of two floats into a 16-bit pair.
//
// NOTE [m16n8k16 fragments] (PTX ISA, "mma.m16n8k16"; lane = 4·g + t, g = lane/4 ∈ 0..7, t = lane%4)
//   A (16×16, row-major), 4 registers of 2 halves each:
//     a0 = A[g][2t..2t+1]   a1 = A[g+8][2t..2t+1]   a2 = A[g][2t+8..2t+9]   a3 = A[g+8][2t+8..2t+9]
//   B (16×8, "col": element B[k][n]), 2 registers:
//     b0 = B[2t..2t+1][g]   b1 = B[2t+8..2t+9][g]
//   C/D (16×8 f32), 4 floats:
//     c0,c1 = C[g][2t..2t+1]   c2,c3 = C[g+8][2t..2t+1]
// So a C fragment of one mma, converted to 16-bit pairs, is laid out exactly like half of an A
// fragment (FlashAttention-2's trick: P = softmax(S) feeds P·V from registers, no shared memory):
//   for key columns 16·kk .. 16·kk+15:  a0 = pack(S[2kk].c0,c1) a1 = pack(S[2kk].c2,c3)
//                                        a2 = pack(S[2kk+1].c0,c1) a3 = pack(S[2kk+1].c2,c3).
// ldmatrix.x4 loads four 8×8 16-bit matrices; lane l supplies the row address of matrix l/8,
// row l%8, and receives in register r the (row g, cols 2t..2t+1) pair of matrix r. With
// addresses "row = l%16, col = 8·(l/16)" of a row-major 16×16 tile it yields an A fragment; the
// .trans form of the same call on a row-major [k][n] tile yields two B fragments (n 0..7 and 8..15)
// when addresses are "row k = l%16 ... " — see ldmatrix_b_trans below for the exact mapping.
// Device-only (no host code): NVRTC compiles it (kernels/device_std.h), given the toolkit's
// include folder for cuda_bf16.h / cuda_fp16.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kiln/kernels/device_std.h"

namespace kiln::kernels::cuda::mma {

// ---- element types ----
template <class T> struct Is16Bit { static constexpr bool value = false; };
template <> struct Is16Bit<__nv_bfloat16> { static constexpr bool value = true; };
template <> struct Is16Bit<__half> { static constexpr bool value = true; };

// Two floats → one 32-bit register of two 16-bit values (lo in the low half).
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// One 32-bit register of two 16-bit values → two floats.
template <class T> __device__ __forceinline__ float2 unpack2(uint32_t r);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t r) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t r) {
  return __half22float2(*reinterpret_cast<__half2*>(&r));
}

// ---- the mma: d += a · b (f32 accumulators) ----
template <class T> __device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- shared-memory addresses ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- ldmatrix (16-bit elements, 8×8 matrices, one row address per lane) ----
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// ---- cp.async: 16 bytes global → shared; when !valid the destination is zero-filled ----
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- swizzled row-major tiles of 16-bit elements ----
// A tile of ROWS × COLS (COLS a multiple of 64: rows of ≥ 128 bytes) stored as 16-byte chunks
// (8 elements); chunk c of row r lives at chunk position c ^ (r % 8) within its 64-element group,
// so ldmatrix (8 rows × 16 bytes at the same column) and cp.async rows hit 8 different banks.
// Returns the element offset of (row, col) with col a multiple of 8.
template <int COLS>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(COLS % 64 == 0, "swizzled tiles need rows of whole 64-element groups");
  const int chunk = col >> 3;
  const int group = chunk >> 3, within = (chunk & 7) ^ (row & 7);
  return row * COLS + group * 64 + within * 8;
}

// The element of a row-major 16×16 block whose address lane `lane` gives ldmatrix.x4 for an A
// fragment (NOTE above): row lane % 16, column 8 · (lane / 16). Any tile layout: the caller
// turns (row0 + row, col0 + col) into its own offset.
struct ALaneAddr {
  int row, col;
};
__device__ __forceinline__ ALaneAddr a_fragment_lane(int lane) { return {lane & 15, (lane >> 4) << 3}; }

// A fragment of the 16×16 block at (row0, col0) of a swizzled [*, COLS] tile.
template <int COLS>
__device__ __forceinline__ void ldmatrix_a(uint32_t (&a)[4], const void* tile_base, int row0, int col0, int lane) {
  const ALaneAddr at = a_fragment_lane(lane);
  ldmatrix_x4(a, smem_addr(static_cast<const uint16_t*>(tile_base) + swz<COLS>(row0 + at.row, col0 + at.col)));
}
// Two B fragments for B = Tileᵀ where the tile is [n][k] row-major (K stored as rows of keys:
// S = Q·Kᵀ): n rows n0..n0+15, k columns k0..k0+15. b[0] covers n0..n0+7, b[1] n0+8..n0+15,
// each as {b0, b1} of the k16 step.
template <int COLS>
__device__ __forceinline__ void ldmatrix_b(uint32_t (&b)[2][2], const void* tile_base, int n0, int k0, int lane) {
  // matrices: 0 = (n0..7, k0..7), 1 = (n0..7, k8..15), 2 = (n8..15, k0..7), 3 = (n8..15, k8..15)
  const int m = lane >> 3;
  const int r = n0 + ((m >> 1) << 3) + (lane & 7), c = k0 + ((m & 1) << 3);
  uint32_t x[4];
  ldmatrix_x4(x, smem_addr(static_cast<const uint16_t*>(tile_base) + swz<COLS>(r, c)));
  b[0][0] = x[0]; b[0][1] = x[1]; b[1][0] = x[2]; b[1][1] = x[3];
}
// Two B fragments for B = Tile where the tile is [k][n] row-major (V stored as rows of keys:
// O = P·V): k rows k0..k0+15, n columns n0..n0+15. b[0] covers n0..n0+7, b[1] n0+8..n0+15.
template <int COLS>
__device__ __forceinline__ void ldmatrix_b_trans(uint32_t (&b)[2][2], const void* tile_base, int k0, int n0, int lane) {
  // matrices: 0 = (k0..7, n0..7), 1 = (k8..15, n0..7), 2 = (k0..7, n8..15), 3 = (k8..15, n8..15)
  const int m = lane >> 3;
  const int r = k0 + ((m & 1) << 3) + (lane & 7), c = n0 + ((m >> 1) << 3);
  uint32_t x[4];
  ldmatrix_x4_trans(x, smem_addr(static_cast<const uint16_t*>(tile_base) + swz<COLS>(r, c)));
  b[0][0] = x[0]; b[0][1] = x[1]; b[1][0] = x[2]; b[1][1] = x[3];
}

}  // namespace kiln::kernels::cuda::mma
