// Helpers of the CUDA tests: the GPU they run on, the floating dtypes they cover, the skip
// without a GPU, and the comparison family (tests/expect.h: CPU against CUDA is all_close with
// device_tol, or same_bits).
#pragma once
#include <cstdint>
#include <gtest/gtest.h>

#include <vector>

#include "kiln/core/device.h"
#include "kiln/ops/ops.h"
#include "tests/expect.h"
#include "tests/skip.h"

namespace kiln::test {

inline Device gpu() { return cuda(0); }

inline const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> v{DType::f32, DType::f64, DType::bf16, DType::f16};
  return v;
}

}  // namespace kiln::test
