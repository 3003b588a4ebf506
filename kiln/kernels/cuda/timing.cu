// CUDA event timing for benchmarks (kiln/kernels/timing.h).
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

void synchronize(int device) { KILN_CUDA_CHECK(cudaStreamSynchronize(stream(device))); }

}  // namespace kiln::kernels::cuda
