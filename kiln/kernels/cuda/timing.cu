// CUDA event timing for benchmarks and the profiler (kiln/kernels/timing.h).
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

void* event_create() {
  cudaEvent_t e;
  KILN_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}
void event_record(void* event, int device) {
  KILN_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), stream(device)));
}
void event_synchronize(void* event) { KILN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }
float event_elapsed_ms(void* start, void* stop) {
  float ms = 0;
  KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(stop)));
  return ms;
}
void event_destroy(void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

}  // namespace kiln::kernels::cuda
