// The CUDA context kiln launches work in, one per device, created on first use: the cuBLASLt
// handle and its workspace, the device's limits and the deferred index checks. It owns no
// stream: kernels launch on the calling thread's current stream of the device (stream(device)
// below: a StreamGuard's, else the device's compute stream of kiln/core/stream.h's registry;
// NOTE [current stream] there). Bodies in kernels/cuda/runtime.cu. Included only by CUDA
// sources (files under a cuda/ folder).
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <vector>

#include "kiln/core/cuda/runtime.h"
#include "kiln/core/device.h"
#include "kiln/core/stream.h"

// Namespace kiln::kernels::cuda (not kiln::cuda: that name is the function kiln::cuda(int)
// of core/device.h, and a namespace of the same name does not compile next to it).
namespace kiln::kernels::cuda {

// Throws kiln::Error naming `what` (and the CUDA error string) when e != cudaSuccess; with
// KILN_CUDA_CHECK / KILN_CUDA_CHECK_LAUNCH, from the core layer's core/cuda/runtime.h.
using ::kiln::core_cuda::check;

struct DeviceContext {
  int device = 0;
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
// The stream work of `device` launches on from this thread: its current stream (StreamGuard's,
// else the registry's compute stream; NOTE [current stream], core/stream.h). Also makes
// `device` the thread's current CUDA device.
inline cudaStream_t stream(int device) {
  context(device);
  return static_cast<cudaStream_t>(::kiln::current_stream(::kiln::Device(::kiln::DeviceType::CUDA, device)).native());
}

// Throws the failure of a deferred index range check of `device` (if any) and forgets the
// checks; call right after the device's stream was synchronised (copy.cu and timing.cu do).
void check_deferred_errors(int device);

}  // namespace kiln::kernels::cuda
