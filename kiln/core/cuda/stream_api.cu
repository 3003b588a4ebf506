// The CUDA StreamApi (kiln/core/stream.h): streams, events and their waits through the CUDA
// runtime. Streams are non-blocking (they do not wait for the legacy default stream); a
// high-priority stream takes the device's greatest priority.
#include "kiln/core/cuda/runtime.h"
#include "kiln/core/stream.h"

namespace kiln {

namespace {

class CudaStreamApi final : public StreamApi {
 public:
  void* create_stream(int device, bool high_priority) override {
    KILN_CUDA_CHECK(cudaSetDevice(device));
    int least = 0, greatest = 0;
    KILN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t s = nullptr;
    KILN_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, high_priority ? greatest : least));
    return s;
  }
  void* create_event(int device, bool timing) override {
    KILN_CUDA_CHECK(cudaSetDevice(device));
    cudaEvent_t e = nullptr;
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }
  void destroy_event(void* event) override { KILN_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event))); }
  void record_event(void* event, void* stream) override {
    KILN_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
  }
  void stream_wait_event(void* stream, void* event) override {
    KILN_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
  }
  bool event_done(void* event) override {
    cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it so later checks do not see it
      return false;
    }
    KILN_CUDA_CHECK(e);
    return true;
  }
  void synchronize_event(void* event) override {
    KILN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  }
  float elapsed_ms(void* start, void* stop) override {
    float ms = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(stop)));
    return ms;
  }
  void synchronize_stream(void* stream) override {
    KILN_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }
};

}  // namespace

StreamApi* cuda_stream_api() {
  static auto* api = new CudaStreamApi();  // NOTE [CUDA registry]: never destroyed
  return api;
}

}  // namespace kiln
