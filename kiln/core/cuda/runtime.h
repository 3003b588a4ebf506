// The core layer's CUDA runtime helpers, for code under a cuda/ folder: check() throws kiln::Error
// naming the call and CUDA's error name and string (KILN_CUDA_CHECK(expr) checks one runtime call,
// KILN_CUDA_CHECK_LAUNCH(name) the last kernel launch), check_device_index(), and per_device(),
// the process-wide table of one kind of per-device state. Bodies in core/cuda/runtime.cu;
// kernels/cuda/context.h brings check() into kiln::kernels::cuda.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstddef>

#include "kiln/core/error.h"

namespace kiln::core_cuda {

// Throws kiln::Error naming `what` (and the CUDA error string) when e != cudaSuccess.
void check(cudaError_t e, const char* what);
// Throws kiln::Error naming `what` unless `device` is a CUDA device of this machine.
void check_device_index(int device, const char* what);

constexpr int kMaxDevices = 64;

// The `Slot` of `device` in a process-wide table of them, one table per Slot type. NOTE [CUDA
// registry]: per-device state (allocators, kernels' contexts) is process-wide because the GPU it
// wraps is; it is created on first use and deliberately never destroyed: tensors in static
// storage may be freed during exit, and CUDA calls after the runtime has shut down would fail.
template <class Slot>
Slot& per_device(int device) {
  static auto* slots = new std::array<Slot, kMaxDevices>();
  KILN_CHECK(device >= 0 && device < kMaxDevices, "cuda: device index ", device, " out of range");
  return (*slots)[static_cast<size_t>(device)];
}

}  // namespace kiln::core_cuda

#define KILN_CUDA_CHECK(expr) ::kiln::core_cuda::check((expr), #expr)
// Checks the last kernel launch.
#define KILN_CUDA_CHECK_LAUNCH(name) ::kiln::core_cuda::check(cudaGetLastError(), name)
