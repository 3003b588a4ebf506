// Device dispatch for kernel entry points: kernels::cpu::name or kernels::cuda::name. In a
// build without CUDA no tensor can live on a GPU (Storage refuses), so the CPU body is the only one.
// Every call is timed by the op-level profiler when one is active (kiln/core/profile.h): the
// Scope temporary lives to the end of the full expression, i.e. around the call.
#pragma once

#include "kiln/core/profile.h"

#ifdef KILN_CUDA
#define KILN_DEVICE_CALL(device, name, ...)                                                                   \
  (::kiln::profile::Scope(#name, (device)),                                                                  \
   ((device).is_cuda() ? ::kiln::kernels::cuda::name(__VA_ARGS__) : ::kiln::kernels::cpu::name(__VA_ARGS__)))
#else
#define KILN_DEVICE_CALL(device, name, ...) \
  (::kiln::profile::Scope(#name, (device)), ::kiln::kernels::cpu::name(__VA_ARGS__))
#endif
