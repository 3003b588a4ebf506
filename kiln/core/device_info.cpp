// The host's entry of list_devices(), read from /proc/cpuinfo and /proc/meminfo.
#include "kiln/core/device_info.h"

#include <fstream>
#include <sstream>

namespace kiln {

static DeviceInfo host_info() {
  DeviceInfo d;
  d.device = kCPU;
  d.name = "cpu";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      auto c = line.find(':');
      if (c != std::string::npos) d.name = line.substr(c + 2);
      break;
    }
  }
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    int64_t kb = 0;
    meminfo >> kb;
    if (key == "MemTotal:") {
      d.memory_total_bytes = kb * 1024;
      break;
    }
    meminfo.ignore(1 << 10, '\n');
  }
  return d;
}

std::vector<DeviceInfo> list_devices() {
  std::vector<DeviceInfo> out{host_info()};
  auto gpus = list_cuda_devices();
  out.insert(out.end(), gpus.begin(), gpus.end());
  return out;
}

}  // namespace kiln
