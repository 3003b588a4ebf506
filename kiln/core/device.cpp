// Parsing and printing of Device, and the availability check shared by every op.
#include "kiln/core/device.h"

#include <charconv>

#include "kiln/core/error.h"

namespace kiln {

Device Device::parse(std::string_view s) {
  if (s == "cpu") return kCPU;
  if (s == "cuda") return Device(DeviceType::CUDA, 0);
  if (s.substr(0, 5) == "cuda:") {
    int idx = -1;
    auto rest = s.substr(5);
    auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), idx);
    if (ec == std::errc() && p == rest.data() + rest.size() && idx >= 0) return Device(DeviceType::CUDA, idx);
  }
  fail("unknown device '", std::string(s), "' (expected cpu, cuda or cuda:N)");
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

void check_device_available(const Device& d, const char* op) {
  if (d.is_cpu()) return;
  KILN_CHECK(cuda_built(), op, ": device ", d.str(), " requested but kiln was built without CUDA");
  int n = cuda_device_count();
  KILN_CHECK(d.index < n, op, ": device ", d.str(), " not available (", n, " CUDA device(s) found)");
}

}  // namespace kiln
