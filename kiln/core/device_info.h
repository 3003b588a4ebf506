// list_devices(): what kiln sees — the host CPU (model name, memory) and each CUDA device
// (name, memory, compute capability) — for `kiln info` and logs.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/device.h"

namespace kiln {

struct DeviceInfo {
  Device device;
  std::string name;
  int64_t memory_total_bytes = 0;
  std::optional<std::string> compute_capability;  // "90" for sm_90 (CUDA only)
};

std::vector<DeviceInfo> list_devices();
// Provided by the CUDA backend (empty without CUDA or without GPUs).
std::vector<DeviceInfo> list_cuda_devices();

}  // namespace kiln
