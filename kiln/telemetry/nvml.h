// NVML (the NVIDIA Management Library) for GPU telemetry, loaded at run time: no header, no
// link-time dependency, so this is plain C++ that builds and runs everywhere. It holds
//   - the few NVML types and constants kiln uses, declared here (nvml.h is not on every build
//     machine). ABI facts from NVIDIA's nvml.h and the NVML API reference
//     (docs.nvidia.com/deploy/nvml-api: nvmlReturn_t values, nvmlMemory_t, nvmlMemory_v2_t and
//     NVML_STRUCT_VERSION, nvmlUtilization_t, nvmlClockType_t, nvmlTemperatureSensors_t);
//   - NvmlApi, the interface every NVML call goes through (pattern 9 of docs/design.md): the
//     real one dlopen()s libnvidia-ml.so.1, tests pass mocks to exercise the failure paths;
//   - NvmlReader, one NVML session (init once, shutdown at the end) that turns a device's
//     answers into Sample fields.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "kiln/core/device.h"

namespace kiln::telemetry {

struct Sample;

namespace nvml {
using Return = int;  // nvmlReturn_t: an enum in nvml.h, passed and returned as int
inline constexpr Return kSuccess = 0;
inline constexpr Return kErrorUninitialized = 1;
inline constexpr Return kErrorInvalidArgument = 2;
inline constexpr Return kErrorNotSupported = 3;
inline constexpr Return kErrorNoPermission = 4;
inline constexpr Return kErrorNotFound = 6;
inline constexpr Return kErrorDriverNotLoaded = 9;
inline constexpr Return kErrorLibraryNotFound = 12;
inline constexpr Return kErrorFunctionNotFound = 13;
inline constexpr Return kErrorGpuIsLost = 15;
inline constexpr Return kErrorUnknown = 999;

struct DeviceSt;                 // opaque
using DeviceHandle = DeviceSt*;  // nvmlDevice_t

// nvmlMemory_t (v1): `used` includes memory the driver reserves.
struct Memory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
// nvmlMemory_v2_t: `used` excludes `reserved`, as nvidia-smi reports it.
struct MemoryV2 {
  unsigned int version;
  unsigned long long total;
  unsigned long long reserved;
  unsigned long long free;
  unsigned long long used;
};
// NVML_STRUCT_VERSION(Memory, 2) = sizeof(nvmlMemory_v2_t) | (2 << 24).
inline constexpr unsigned int kMemoryV2Version = static_cast<unsigned int>(sizeof(MemoryV2)) | (2u << 24);
static_assert(sizeof(MemoryV2) == 40, "nvmlMemory_v2_t is 40 bytes on LP64");

// nvmlUtilization_t: percentages over the driver's last sample period (1/6 s to 1 s).
struct Utilization {
  unsigned int gpu;
  unsigned int memory;
};
inline constexpr int kClockGraphics = 0;  // nvmlClockType_t
inline constexpr int kClockSm = 1;
inline constexpr int kClockMem = 2;
inline constexpr int kTemperatureGpu = 0;  // nvmlTemperatureSensors_t
}  // namespace nvml

// Thin wrappers over the NVML functions of the same names.
class NvmlApi {
 public:
  virtual ~NvmlApi() = default;
  // Loads the library and its symbols. Returns "" on success, else why not (dlerror()).
  virtual std::string load() = 0;
  virtual nvml::Return init() = 0;      // nvmlInit_v2
  virtual nvml::Return shutdown() = 0;  // nvmlShutdown
  virtual nvml::Return device_count(unsigned int* count) = 0;  // nvmlDeviceGetCount_v2
  virtual nvml::Return handle_by_index(unsigned int index, nvml::DeviceHandle* h) = 0;  // ..._v2
  virtual nvml::Return handle_by_pci_bus_id(const char* bus_id, nvml::DeviceHandle* h) = 0;  // ..._v2
  virtual nvml::Return memory_info(nvml::DeviceHandle h, nvml::Memory* m) = 0;
  // nvmlDeviceGetMemoryInfo_v2; kErrorFunctionNotFound where the driver predates it.
  virtual nvml::Return memory_info_v2(nvml::DeviceHandle h, nvml::MemoryV2* m) = 0;
  virtual nvml::Return utilization(nvml::DeviceHandle h, nvml::Utilization* u) = 0;
  virtual nvml::Return power_usage(nvml::DeviceHandle h, unsigned int* milliwatts) = 0;
  virtual nvml::Return clock_info(nvml::DeviceHandle h, int clock_type, unsigned int* mhz) = 0;
  virtual nvml::Return temperature(nvml::DeviceHandle h, int sensor, unsigned int* celsius) = 0;
  virtual std::string error_string(nvml::Return r) = 0;  // nvmlErrorString
};

// The real NVML: dlopen(library) at load(). Every call before a successful load() answers
// kErrorUninitialized; a missing optional symbol answers kErrorFunctionNotFound.
std::unique_ptr<NvmlApi> make_nvml_api(std::string library = "libnvidia-ml.so.1");

// One NVML session. The first use loads the library and calls nvmlInit_v2 (once: the outcome
// is kept); the destructor calls nvmlShutdown when init succeeded. Not thread-safe (Sampler
// serialises calls).
class NvmlReader {
 public:
  explicit NvmlReader(std::unique_ptr<NvmlApi> api);
  ~NvmlReader();
  NvmlReader(const NvmlReader&) = delete;
  NvmlReader& operator=(const NvmlReader&) = delete;

  // Whether NVML loaded and initialised; else unavailable_reason() says why.
  bool available();
  const std::string& unavailable_reason() const { return reason_; }
  // GPUs NVML sees (0 when unavailable).
  int device_count();

  // Fills the GPU fields of `s` for `device`, found by `pci_bus_id` when given ("0000:18:00.0",
  // what the CUDA runtime reports for kiln's cuda:N), else by NVML index device.index.
  // A query that fails leaves its fields absent and adds a note; NVML unavailable leaves them
  // all absent with a note. Throws kiln::Error naming the device when the index is past NVML's
  // device count or NVML knows no GPU at that bus id.
  void read(const Device& device, Sample& s, const std::string& pci_bus_id = {});

 private:
  nvml::DeviceHandle handle(const Device& device, const std::string& pci_bus_id);
  std::string describe(nvml::Return r);

  std::unique_ptr<NvmlApi> api_;
  bool tried_ = false;
  bool ok_ = false;
  std::string reason_;
  std::map<std::string, nvml::DeviceHandle> handles_;  // by "#index" or bus id
};

// The PCI bus id of kiln's cuda:N, from the CUDA runtime (kiln/telemetry/cuda/); "" in a build
// without CUDA or when the runtime cannot say. NVML numbers GPUs by PCI order and ignores
// CUDA_VISIBLE_DEVICES, so this is how cuda:N finds its NVML device.
std::string cuda_pci_bus_id(int cuda_index);

}  // namespace kiln::telemetry
