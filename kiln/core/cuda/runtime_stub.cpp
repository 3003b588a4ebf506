// CPU-only build: the CUDA entry points of kiln/core say "built without CUDA".
#include "kiln/core/allocator.h"
#include "kiln/core/device.h"
#include "kiln/core/error.h"
#include "kiln/core/stream.h"

namespace kiln {

bool cuda_built() { return false; }
StreamApi* cuda_stream_api() { return nullptr; }
int cuda_device_count() { return 0; }
Allocator& cuda_caching_allocator(int index) {
  fail("cuda:", index, ": kiln was built without CUDA (configure with the 'cuda' preset)");
}

}  // namespace kiln

#include "kiln/core/device_info.h"
namespace kiln {
std::vector<DeviceInfo> list_cuda_devices() { return {}; }
}  // namespace kiln
