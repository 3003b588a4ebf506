// Half and BFloat16: 16-bit float storage types, bit-compatible with CUDA's __half and
// __nv_bfloat16, converting to and from float with round-to-nearest-even on host and device.
#pragma once
#include <cstdint>
#include <cstring>

#include "kiln/core/macros.h"

namespace kiln {

KILN_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
KILN_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  KILN_HD BFloat16(float f) {
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  KILN_HD operator float() const { return bits_float(static_cast<uint32_t>(bits) << 16); }
  static KILN_HD BFloat16 from_bits(uint16_t b) { BFloat16 h; h.bits = b; return h; }
};

struct Half {
  uint16_t bits = 0;
  Half() = default;
  KILN_HD Half(float f) {
    uint32_t x = float_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {  // inf or NaN
      bits = static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
      return;
    }
    if (ax >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
      bits = static_cast<uint16_t>(sign | 0x7c00u);
      return;
    }
    if (ax < 0x38800000u) {  // subnormal or zero in half
      // value = ax as float; half subnormal unit is 2^-24
      float v = bits_float(ax) * 16777216.0f;  // exact scaling by 2^24
      // round to nearest even integer
      uint32_t iv = static_cast<uint32_t>(v);
      float frac = v - static_cast<float>(iv);
      if (frac > 0.5f || (frac == 0.5f && (iv & 1u))) ++iv;
      bits = static_cast<uint16_t>(sign | iv);
      return;
    }
    uint32_t e = ((ax >> 23) - 112u) << 10;
    uint32_t m = ax & 0x7fffffu;
    uint32_t h = e | (m >> 13);
    uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    bits = static_cast<uint16_t>(sign | h);
  }
  KILN_HD operator float() const {
    uint32_t sign = (static_cast<uint32_t>(bits) & 0x8000u) << 16;
    uint32_t e = (bits >> 10) & 0x1fu;
    uint32_t m = bits & 0x3ffu;
    if (e == 0) {
      float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // 2^-24
      return sign ? -v : v;
    }
    if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
    return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  }
  static KILN_HD Half from_bits(uint16_t b) { Half h; h.bits = b; return h; }
};

}  // namespace kiln
