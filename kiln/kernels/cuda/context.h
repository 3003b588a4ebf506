// The CUDA context kiln launches work in, one per device, created on first use: the stream
// every kernel of that device runs on, the cuBLASLt handle and its workspace. Bodies in
// kernels/cuda/runtime.cu. Included only by CUDA sources (files under a cuda/ folder).
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>

// Namespace kiln::kernels::cuda (not kiln::cuda: that name is the function kiln::cuda(int)
// of core/device.h, and a namespace of the same name does not compile next to it).
namespace kiln::kernels::cuda {

// Throws kiln::Error naming `what` (and the CUDA error string) when e != cudaSuccess.
void check(cudaError_t e, const char* what);
#define KILN_CUDA_CHECK(expr) ::kiln::kernels::cuda::check((expr), #expr)
// Checks the last kernel launch.
#define KILN_CUDA_CHECK_LAUNCH(name) ::kiln::kernels::cuda::check(cudaGetLastError(), name)

struct DeviceContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t cublaslt = nullptr;
  void* workspace = nullptr;       // cuBLASLt workspace
  size_t workspace_bytes = 0;
  int sm_count = 0;
  size_t max_shared_per_block = 0;  // opt-in maximum
};

// The context of `device` (also makes it the current device of the calling thread).
DeviceContext& context(int device);
inline cudaStream_t stream(int device) { return context(device).stream; }

}  // namespace kiln::kernels::cuda
