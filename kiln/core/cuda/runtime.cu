// The CUDA runtime of the core layer: device queries (cuda_built, cuda_device_count,
// list_cuda_devices), error checking (core_cuda::check, check.h) and the per-device caching
// allocators (CachingAllocator from kiln/core/caching_allocator.h with cudaMalloc, cudaFree and
// the stream runtime's events plugged in). The kernels' per-device contexts (cuBLASLt handle,
// workspace, limits) are kernels/cuda/context.h's, a layer up.
#include <memory>
#include <mutex>
#include <string>

#include "kiln/core/allocator.h"
#include "kiln/core/caching_allocator.h"
#include "kiln/core/cuda/runtime.h"
#include "kiln/core/device.h"
#include "kiln/core/device_info.h"
#include "kiln/core/error.h"
#include "kiln/core/profile.h"
#include "kiln/core/stream.h"

namespace kiln {

namespace core_cuda {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  fail("CUDA error in ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

namespace {

// cudaMalloc/cudaFree on one device; blocks are tagged with the thread's current stream.
class CudaMemoryApi final : public DeviceMemoryApi {
 public:
  explicit CudaMemoryApi(int device) : device_(device) {}
  void* malloc(size_t nbytes) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, nbytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the (non-sticky) error so later checks do not see it
      return nullptr;
    }
    check(e, "cudaMalloc");
    return p;
  }
  void free(void* p) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    // A cached block may still be read by queued work of its stream: wait for it first.
    profile::count_sync("cudaFree (allocator release)");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (before cudaFree)");
    check(cudaFree(p), "cudaFree");
  }
  // The thread's current stream of the device (NOTE [current stream], core/stream.h).
  void* current_stream() override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    return ::kiln::current_stream(Device(DeviceType::CUDA, device_)).native();
  }
  void memset(void* p, uint8_t byte, size_t nbytes, void* stream) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaMemsetAsync(p, byte, nbytes, static_cast<cudaStream_t>(stream)), "cudaMemsetAsync (allocator fill)");
  }
  // NOTE [deferred frees] (core/caching_allocator.h): the stream runtime's events, created per
  // deferred free (a block used on another stream; rare) and destroyed once seen complete.
  void* record_event(void* stream) override {
    StreamApi* api = cuda_stream_api();
    void* e = api->create_event(device_, /*timing=*/false);
    try {
      api->record_event(e, stream);
    } catch (...) {
      api->destroy_event(e);
      throw;
    }
    return e;
  }
  bool event_done(void* event) override { return cuda_stream_api()->event_done(event); }
  void synchronize_event(void* event) override {
    profile::count_sync("cudaEventSynchronize (allocator: a block used on another stream)");
    cuda_stream_api()->synchronize_event(event);
  }
  void release_event(void* event) override { cuda_stream_api()->destroy_event(event); }

 private:
  int device_;
};

struct AllocatorSlot {
  std::once_flag once;
  std::unique_ptr<CudaMemoryApi> api;
  std::unique_ptr<CachingAllocator> allocator;
};

}  // namespace

void check_device_index(int device, const char* what) {
  int n = cuda_device_count();
  KILN_CHECK(device >= 0 && device < n, what, ": CUDA device ", device, " not available (", n,
             " device(s) found)");
}

}  // namespace core_cuda

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {  // no driver, no GPU, or a driver too old: no devices
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

Allocator& cuda_caching_allocator(int index) {
  auto& s = core_cuda::per_device<core_cuda::AllocatorSlot>(index);
  std::call_once(s.once, [&] {
    core_cuda::check_device_index(index, "cuda allocator");
    s.api = std::make_unique<core_cuda::CudaMemoryApi>(index);
    s.allocator = std::make_unique<CachingAllocator>(s.api.get(), "cuda:" + std::to_string(index));
  });
  KILN_CHECK(s.allocator != nullptr, "cuda: the allocator of device ", index, " failed to initialise earlier");
  return *s.allocator;
}

std::vector<DeviceInfo> list_cuda_devices() {
  std::vector<DeviceInfo> out;
  int n = cuda_device_count();
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    DeviceInfo d;
    d.device = Device(DeviceType::CUDA, i);
    d.name = p.name;
    d.memory_total_bytes = static_cast<int64_t>(p.totalGlobalMem);
    d.compute_capability = std::to_string(p.major) + std::to_string(p.minor);
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace kiln
