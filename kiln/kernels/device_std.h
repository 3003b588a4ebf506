// The few standard-library pieces that device-only kernel headers use (fixed-width integers and
// is_same_v), for host compilers and for NVRTC, which has no C++ standard library (it defines
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
}  // namespace kiln::dev
#else
#include <cstdint>
#include <type_traits>
namespace kiln::dev {
using std::is_same_v;
}  // namespace kiln::dev
#endif
