// The CUDA context kiln launches work in, one per device, created on first use: the stream
// every kernel of that device runs on, the cuBLASLt handle and its workspace. Bodies in
// kernels/cuda/runtime.cu. Included only by CUDA sources (files under a cuda/ folder).
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <vector>

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
  // Deferred index range checks (defer_range_check in kernels/nn.h): the kernels write the
  // first failure into `index_error` (pinned, mapped host memory); the host reads it after the
  // next stream synchronisation (check_deferred_errors) and names the op from `index_checks`.
  struct IndexError {
    unsigned int set;    // 1 once a check failed
    unsigned int check;  // index into index_checks
    long long pos, value;
  };
  struct IndexCheck {
    std::string what, tail;  // message: what[pos]=value tail
  };
  IndexError* index_error = nullptr;
  std::vector<IndexCheck> index_checks;  // since the last synchronisation (host thread only)
};

// The context of `device` (also makes it the current device of the calling thread).
DeviceContext& context(int device);
inline cudaStream_t stream(int device) { return context(device).stream; }

// Throws the failure of a deferred index range check of `device` (if any) and forgets the
// checks; call right after the device's stream was synchronised (copy.cu and timing.cu do).
void check_deferred_errors(int device);

}  // namespace kiln::kernels::cuda
