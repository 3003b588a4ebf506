// The CUDA runtime layer of kiln: device queries (cuda_built, cuda_device_count,
// list_cuda_devices), error checking (cuda::check), the per-device contexts (cuBLASLt handle,
// workspace, limits; kernels launch on the current stream, context.h) and the per-device
// caching allocators (CachingAllocator from kiln/core/caching_allocator.h with cudaMalloc,
// cudaFree and the stream runtime's events plugged in).
#include <array>
#include <memory>
#include <mutex>
#include <string>

#include "kiln/core/allocator.h"
#include "kiln/core/caching_allocator.h"
#include "kiln/core/device.h"
#include "kiln/core/device_info.h"
#include "kiln/core/error.h"
#include "kiln/core/profile.h"
#include "kiln/core/stream.h"
#include "kiln/kernels/cuda/context.h"

namespace kiln {

namespace kernels::cuda {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  fail("CUDA error in ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

namespace {

constexpr int kMaxDevices = 64;
constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt workspace per device

void check_cublas(cublasStatus_t s, const char* what) {
  KILN_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuBLASLt error in ", what, ": status ", static_cast<int>(s));
}

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
  void* current_stream() override { return stream(device_); }
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

struct DeviceSlot {
  std::once_flag context_once, allocator_once;
  std::unique_ptr<DeviceContext> context;
  std::unique_ptr<CudaMemoryApi> api;
  std::unique_ptr<CachingAllocator> allocator;
};

// NOTE [CUDA registry]: contexts and allocators are process-wide because the GPU they wrap is.
// They are created on first use and deliberately never destroyed: tensors in static storage
// may be freed during exit, and CUDA calls after the runtime has shut down would fail.
DeviceSlot& slot(int device) {
  static auto* slots = new std::array<DeviceSlot, kMaxDevices>();
  KILN_CHECK(device >= 0 && device < kMaxDevices, "cuda: device index ", device, " out of range");
  return (*slots)[static_cast<size_t>(device)];
}

void check_index(int device, const char* what) {
  int n = cuda_device_count();
  KILN_CHECK(device >= 0 && device < n, what, ": CUDA device ", device, " not available (", n,
             " device(s) found)");
}

}  // namespace

DeviceContext& context(int device) {
  DeviceSlot& s = slot(device);
  std::call_once(s.context_once, [&] {
    check_index(device, "cuda context");
    check(cudaSetDevice(device), "cudaSetDevice");
    auto ctx = std::make_unique<DeviceContext>();
    ctx->device = device;
    check_cublas(cublasLtCreate(&ctx->cublaslt), "cublasLtCreate");
    // The workspace comes straight from cudaMalloc so that it does not show in tensor memory stats.
    check(cudaMalloc(&ctx->workspace, kWorkspaceBytes), "cudaMalloc (cuBLASLt workspace)");
    ctx->workspace_bytes = kWorkspaceBytes;
    check(cudaDeviceGetAttribute(&ctx->sm_count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    int smem = 0;
    check(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
    ctx->max_shared_per_block = static_cast<size_t>(smem);
    s.context = std::move(ctx);
  });
  KILN_CHECK(s.context != nullptr, "cuda: the context of device ", device, " failed to initialise earlier");
  check(cudaSetDevice(device), "cudaSetDevice");
  return *s.context;
}

}  // namespace kernels::cuda

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
  kernels::cuda::DeviceSlot& s = kernels::cuda::slot(index);
  std::call_once(s.allocator_once, [&] {
    kernels::cuda::check_index(index, "cuda allocator");
    s.api = std::make_unique<kernels::cuda::CudaMemoryApi>(index);
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
