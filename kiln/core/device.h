// Device: where a tensor lives ("cpu" or "cuda:N"), parsed from and printed as text.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

namespace kiln {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}
  // "cpu", "cuda", "cuda:1"
  static Device parse(std::string_view s);

  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  std::string str() const;
  friend bool operator==(const Device&, const Device&) = default;
};

inline constexpr Device kCPU{};
inline Device cuda(int index = 0) { return Device(DeviceType::CUDA, index); }
inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

// Whether this build has the CUDA backend, and how many GPUs the process sees (0 without).
bool cuda_built();
int cuda_device_count();
// Throws kiln::Error when `d` is a CUDA device and this build or machine cannot use it.
void check_device_available(const Device& d, const char* op);

}  // namespace kiln
