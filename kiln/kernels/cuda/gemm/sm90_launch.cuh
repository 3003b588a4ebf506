// The launcher template of kiln's Hopper GEMM (launch.h): tensor maps of A and B in the
// orientation the kernel reads (NOTE [kiln sm90 gemm]) and of the output where its tiles leave by
// TMA, the tile width, the persistent grid, the
// shared-memory opt-in, and the 2 × 4 (tile width × layout) instantiations of sm90_gemm_kernel
// with the run-time epilogue.
// Included by one .cu file per input dtype (sm90_bf16.cu, sm90_f16.cu: they compile in parallel).
#pragma once
#include <algorithm>

#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/gemm/launch.h"
#include "kiln/kernels/cuda/gemm/sm90_gemm.cuh"
#include "kiln/kernels/cuda/tensor_map.h"

namespace kiln::kernels::cuda::gemm_sm90 {

// The map of one operand: [batch (1 when broadcast), 1, rows, cols], boxes of 64 columns ×
// `tile_rows` rows (K-major: 64 K × the tile's M or N) or 64 rows (MN-major: 64 M/N × 64 K).
inline bool encode_operand(CUtensorMap* map, bool is_bf16, const Operand& o, int64_t batch, int tile_rows) {
  const bool batched = o.bstride != 0 && batch > 1;
  return wgmma::encode_tensor_map_16bit(map, is_bf16, o.ptr, batched ? batch : 1, 1, o.rows, o.cols,
                                        batched ? o.bstride : 0, 0, o.ld, o.k_major ? tile_rows : 64);
}

// The tile width: 128 unless Launch::tile_n fixes it. On the H200 (2026-12-04, BENCHMARKS.md)
// the 128 × 256 tiles ran slower at every shape measured (8192³: 497 against 654 TFLOP/s;
// 4096³: 357 against 552), so they are taken only when asked for.
inline int choose_tile_n(const Launch& l) { return l.tile_n == 256 ? 256 : 128; }

template <class T, int BN, bool kAKMajor, bool kBKMajor>
void launch_layout(const Launch& l, const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& mc,
                   const Sm90Problem& p, const EpiParams& ep) {
  auto kernel = sm90_gemm_kernel<T, BN, kAKMajor, kBKMajor, RtEpilogue<T>>;
  constexpr int kSmemBytes = Smem<BN>::kBytes;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const int64_t tiles = static_cast<int64_t>(p.batch) * p.tiles_m * p.tiles_n;
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(tiles, l.sm_count)));
  RtEpilogue<T> epi{ep};
  kernel<<<grid, kThreads, kSmemBytes, l.stream>>>(ma, mb, mc, p, epi);
  KILN_CUDA_CHECK_LAUNCH("kiln gemm (sm90)");
}

template <class T, int BN>
bool launch_tile(const Launch& l, bool is_bf16) {
  CUtensorMap ma, mb, mc{};
  if (!encode_operand(&ma, is_bf16, l.a, l.batch, kBM) || !encode_operand(&mb, is_bf16, l.b, l.batch, BN)) return false;
  EpiParams ep = l.epi;
  ep.staged = encode_output_map(l, is_bf16, &mc);
  Sm90Problem p{};
  p.m = static_cast<int>(l.m), p.n = static_cast<int>(l.n), p.k = static_cast<int>(l.k);
  p.batch = static_cast<int>(l.batch);
  p.tiles_m = static_cast<int>((l.m + kBM - 1) / kBM), p.tiles_n = static_cast<int>((l.n + BN - 1) / BN);
  p.k_blocks = static_cast<int>((l.k + kBK - 1) / kBK);
  p.a_batched = l.a.bstride != 0 && l.batch > 1, p.b_batched = l.b.bstride != 0 && l.batch > 1;
  p.a_nonzero = l.a_nonzero, p.nz_sm = l.nz_sm, p.nz_sk = l.nz_sk;
  if (l.a.k_major && l.b.k_major) launch_layout<T, BN, true, true>(l, ma, mb, mc, p, ep);
  else if (l.a.k_major) launch_layout<T, BN, true, false>(l, ma, mb, mc, p, ep);
  else if (l.b.k_major) launch_layout<T, BN, false, true>(l, ma, mb, mc, p, ep);
  else launch_layout<T, BN, false, false>(l, ma, mb, mc, p, ep);
  return true;
}

template <class T>
bool launch_impl(const Launch& l, bool is_bf16) {
  return choose_tile_n(l) == 256 ? launch_tile<T, 256>(l, is_bf16) : launch_tile<T, 128>(l, is_bf16);
}

}  // namespace kiln::kernels::cuda::gemm_sm90
