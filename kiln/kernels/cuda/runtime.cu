// The per-device contexts kernels launch in (context.h): the cuBLASLt handle and its workspace
// and the device's limits, created on first use. The device queries, error checks and caching
// allocators below them are the core layer's (core/cuda/runtime.cu).
#include <memory>
#include <mutex>

#include "kiln/core/cuda/runtime.h"
#include "kiln/core/error.h"
#include "kiln/kernels/cuda/context.h"

namespace kiln::kernels::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt workspace per device

void check_cublas(cublasStatus_t s, const char* what) {
  KILN_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuBLASLt error in ", what, ": status ", static_cast<int>(s));
}

struct ContextSlot {
  std::once_flag once;
  std::unique_ptr<DeviceContext> context;
};

}  // namespace

DeviceContext& context(int device) {
  // NOTE [CUDA registry] (core/cuda/runtime.h): created on first use, never destroyed.
  auto& s = core_cuda::per_device<ContextSlot>(device);
  std::call_once(s.once, [&] {
    core_cuda::check_device_index(device, "cuda context");
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

}  // namespace kiln::kernels::cuda
