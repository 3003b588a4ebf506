// Helpers of the CUDA tests: the GPU they run on, the floating dtypes they cover, the skip
// without a GPU, whether kiln's Hopper GEMM runs there, and the comparison family
// (tests/expect.h: CPU against CUDA is all_close with device_tol, or same_bits).
#pragma once
#include <cstdint>
#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <vector>

#include "kiln/core/device.h"
#include "kiln/kernels/cuda/gemm/gemm.h"
#include "kiln/ops/ops.h"
#include "tests/expect.h"
#include "tests/skip.h"

namespace kiln::test {

inline Device gpu() { return cuda(0); }

// Whether this GPU runs kiln's GEMM kernel at all (sm_90): asked on a tiny aligned problem; says
// why not on stderr.
inline bool kiln_gemm_available() {
  kernels::gemm::GemmProblem p;
  p.a = zeros({8, 8}, DType::bf16, gpu()), p.b = zeros({8, 8}, DType::bf16, gpu()), p.out = zeros({8, 8}, DType::bf16, gpu());
  std::string why;
  const bool ok = kernels::gemm::kiln_supported(p, {}, &why);
  if (!ok) std::cerr << "kiln's GEMM kernel does not apply here: " << why << "\n";
  return ok;
}

inline const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> v{DType::f32, DType::f64, DType::bf16, DType::f16};
  return v;
}

}  // namespace kiln::test
