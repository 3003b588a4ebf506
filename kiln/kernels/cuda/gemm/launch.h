// The host side of kiln's Hopper GEMM kernel (sm90_gemm.cuh), for gemm.cpp: a problem in the
// kernel's terms (row-major operands with their orientation, the epilogue's parameters) and
// one launcher per input dtype (sm90_bf16.cu, sm90_f16.cu). CUDA host code.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kiln/kernels/cuda/gemm/epilogue.cuh"
#include "kiln/kernels/cuda/tensor_map.h"

namespace kiln::kernels::cuda::gemm_sm90 {

// A row-major operand: `rows` × `cols` elements, row stride `ld`, batch stride `bstride`
// (elements; 0 broadcasts). For A, K-major means rows = M, cols = K; MN-major rows = K, cols = M
// (and likewise for B with N).
struct Operand {
  const void* ptr = nullptr;
  int64_t rows = 0, cols = 0, ld = 0, bstride = 0;
  bool k_major = true;
};

struct Launch {
  int device = 0;
  cudaStream_t stream = nullptr;
  int sm_count = 1;
  int tile_n = 0;  // 128 or 256 output columns a tile; 0: chosen (sm90_launch.cuh)
  bool direct_store = false;  // the epilogue stores from registers even where its tiles could leave by TMA
  int64_t m = 0, n = 0, k = 0, batch = 1;
  Operand a, b;
  EpiParams epi{};
  // Block-sparse A (GemmProblem::a_nonzero): flags of A's 64 × 64 blocks, strides in flags per
  // 64-row block of M and per K block; null: dense.
  const unsigned char* a_nonzero = nullptr;
  int64_t nz_sm = 0, nz_sk = 0;
};

// Whether the kernel stores the output's tiles by TMA (NOTE [kiln sm90 gemm]), encoding `map`
// (boxes of 64 × 64) when it does: for the kinds that store their tile as computed
// (RtEpilogue::kStageable) into a 16-bit out, unless the launch asks for direct stores or the
// map cannot describe out (its base, rows or batch stride not 16-byte multiples).
inline bool encode_output_map(const Launch& l, bool is_bf16, CUtensorMap* map) {
  const EpiParams& e = l.epi;
  const bool stageable = !e.out_f32 && (e.kind == kEpiNone || e.kind == kEpiBias || e.kind == kEpiResidual ||
                                        e.kind == kEpiRowLse || e.kind == kEpiRowSumsq);
  if (l.direct_store || !stageable) return false;
  const bool batched = l.batch > 1;
  return wgmma::encode_tensor_map_16bit(map, is_bf16, e.out, batched ? l.batch : 1, 1, l.m, l.n,
                                        batched ? e.out_bstride : 0, 0, e.ldo, 64);
}

// Encodes the tensor maps and launches; false (nothing launched) when a tensor map cannot
// describe an operand. The caller has checked kiln_supported's conditions.
bool launch_bf16(const Launch& l);
bool launch_f16(const Launch& l);

}  // namespace kiln::kernels::cuda::gemm_sm90
