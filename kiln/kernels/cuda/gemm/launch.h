// The host side of kiln's Hopper GEMM kernel (sm90_gemm.cuh), for gemm.cpp: a problem in the
// kernel's terms (row-major operands with their orientation, the epilogue's parameters) and
// one launcher per input dtype (sm90_bf16.cu, sm90_f16.cu). CUDA host code.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kiln/kernels/cuda/gemm/epilogue.cuh"

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
  int64_t m = 0, n = 0, k = 0, batch = 1;
  Operand a, b;
  EpiParams epi{};
};

// Encodes the tensor maps and launches; false (nothing launched) when a tensor map cannot
// describe an operand. The caller has checked kiln_supported's conditions.
bool launch_bf16(const Launch& l);
bool launch_f16(const Launch& l);

}  // namespace kiln::kernels::cuda::gemm_sm90
