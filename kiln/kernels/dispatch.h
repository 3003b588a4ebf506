// Device dispatch for kernel entry points: kernels::cpu::name or kernels::cuda::name. In a
// build without CUDA no tensor can live on a GPU (Storage refuses), so the CPU body is the only one.
#pragma once

#ifdef KILN_CUDA
#define KILN_DEVICE_CALL(device, name, ...) \
  ((device).is_cuda() ? ::kiln::kernels::cuda::name(__VA_ARGS__) : ::kiln::kernels::cpu::name(__VA_ARGS__))
#else
#define KILN_DEVICE_CALL(device, name, ...) ::kiln::kernels::cpu::name(__VA_ARGS__)
#endif
