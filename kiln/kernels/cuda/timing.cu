// CUDA event timing for kernel code and the device synchronisation (kiln/kernels/timing.h).
#include "kiln/core/profile.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/timing.h"

namespace kiln::kernels::cuda {

double time_ms(int device, const std::function<void()>& f) {
  cudaStream_t s = stream(device);
  cudaEvent_t a, b;
  KILN_CUDA_CHECK(cudaEventCreate(&a));
  KILN_CUDA_CHECK(cudaEventCreate(&b));
  KILN_CUDA_CHECK(cudaEventRecord(a, s));
  f();
  KILN_CUDA_CHECK(cudaEventRecord(b, s));
  KILN_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

void synchronize(int device) {
  profile::count_sync("synchronize");
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream(device)));
  check_deferred_errors(device);
}

}  // namespace kiln::kernels::cuda
