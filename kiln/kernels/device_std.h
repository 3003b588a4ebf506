// The few standard-library pieces that device-only kernel headers use (fixed-width integers,
// is_same_v, integral_constant and INFINITY), for host compilers and for NVRTC, which has no C++ standard library (it defines
// __CUDACC_RTC__). A header that includes only this, kiln/core/macros.h and other device-only
// headers compiles under NVRTC: the JIT (kiln/jit/) builds run-time kernels from them.
#pragma once
#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
namespace kiln::dev {
template <class A, class B> inline constexpr bool is_same_v = false;
template <class A> inline constexpr bool is_same_v<A, A> = true;
template <class T, T v> struct integral_constant {
  static constexpr T value = v;
};
using true_type = integral_constant<bool, true>;
using false_type = integral_constant<bool, false>;
}  // namespace kiln::dev
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#else
#include <math.h>

#include <cstdint>
#include <type_traits>
namespace kiln::dev {
using std::false_type;
using std::integral_constant;
using std::is_same_v;
using std::true_type;
}  // namespace kiln::dev
#endif
