// DivMod32: unsigned 32-bit division by a fixed divisor as a multiply-high, an add and a shift,
// on host and device (the CUDA elementwise launcher's strided indexing, kernels/cuda/indexing.cuh,
// divides every element's flat index by each dimension's size). Exact for every dividend below
// 2^31 (Granlund and Montgomery's round-up method: shift = ceil(log2 d), magic =
// floor(2^32 (2^shift - d) / d) + 1, n / d = (mulhi(n, magic) + n) >> shift; magic fits 32 bits
// because 2^(shift-1) < d, and mulhi(n, magic) <= n keeps the sum below 2^32).
#pragma once
#include <cstdint>

#include "kiln/core/macros.h"

namespace kiln::kernels {

struct DivMod32 {
  uint32_t d = 1, magic = 1, shift = 0;
  DivMod32() = default;
  explicit DivMod32(uint32_t divisor) : d(divisor) {
    while (shift < 32 && (uint64_t{1} << shift) < divisor) ++shift;
    magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
  }
  // n / d for n < 2^31.
  KILN_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, magic);
#else
    const auto hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * magic) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

}  // namespace kiln::kernels
