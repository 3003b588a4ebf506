// Helpers of the CUDA tests: skip without a GPU, fresh random inputs, and CPU-vs-CUDA
// comparison with per-dtype tolerances (reporting the first mismatches and their count).
#pragma once
#include <cstdint>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/core/device.h"
#include "kiln/ops/ops.h"
#include "tests/skip.h"

namespace kiln::test {

inline Device gpu() { return cuda(0); }

// Relative tolerance of one rounding (plus slack for ulp-level math differences) per dtype.
inline double rel_tol(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 2e-5;
    case DType::f16: return 4e-3;
    case DType::bf16: return 2e-2;
    default: return 0.0;
  }
}

// Expects `got` (any device) to equal `expected` (CPU) within |d| <= atol + rtol·|expected|,
// NaN matching NaN. Shapes and dtypes must agree.
inline void expect_close(const Tensor& expected, const Tensor& got, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(expected.shape(), got.shape()) << what;
  ASSERT_EQ(expected.dtype(), got.dtype()) << what;
  std::vector<double> e = expected.to(kCPU).to(DType::f64).to_vector<double>();
  std::vector<double> g = got.to(kCPU).to(DType::f64).to_vector<double>();
  int64_t bad = 0;
  std::ostringstream first;
  for (size_t i = 0; i < e.size(); ++i) {
    bool ok = (std::isnan(e[i]) && std::isnan(g[i])) || e[i] == g[i] ||
              std::fabs(e[i] - g[i]) <= atol + rtol * std::fabs(e[i]);
    if (!ok && bad++ < 5) first << "  [" << i << "] expected " << e[i] << " got " << g[i] << "\n";
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << e.size() << " elements differ (rtol " << rtol << ", atol "
                    << atol << ")\n" << first.str();
}
inline void expect_close(const Tensor& expected, const Tensor& got, const std::string& what) {
  double r = rel_tol(expected.dtype());
  expect_close(expected, got, r, r, what);
}

// Byte-for-byte equality of two tensors' elements (any devices, same dtype and shape).
inline void expect_same_bits(const Tensor& expected, const Tensor& got, const std::string& what) {
  ASSERT_EQ(expected.shape(), got.shape()) << what;
  ASSERT_EQ(expected.dtype(), got.dtype()) << what;
  Tensor e = expected.to(kCPU).contiguous(), g = got.to(kCPU).contiguous();
  const auto* pe = static_cast<const uint8_t*>(e.data_ptr());
  const auto* pg = static_cast<const uint8_t*>(g.data_ptr());
  const size_t es = itemsize(e.dtype());
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < e.numel(); ++i)
    if (std::memcmp(pe + i * es, pg + i * es, es) != 0) {
      if (first < 0) first = i;
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << e.numel() << " elements differ in bits (first at " << first
                    << ")";
}

inline const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> v{DType::f32, DType::f64, DType::bf16, DType::f16};
  return v;
}

}  // namespace kiln::test
