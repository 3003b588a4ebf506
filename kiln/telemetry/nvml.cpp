// The dlopen implementation of NvmlApi and NvmlReader, which turns NVML's answers for one GPU
// into Sample fields (see nvml.h).
#include "kiln/telemetry/nvml.h"

#include <dlfcn.h>

#include <type_traits>

#include "kiln/core/error.h"
#include "kiln/telemetry/telemetry.h"

namespace kiln::telemetry {
namespace {

using nvml::DeviceHandle;
using nvml::Return;

class DlopenNvml final : public NvmlApi {
 public:
  explicit DlopenNvml(std::string library) : library_(std::move(library)) {}
  ~DlopenNvml() override {
    if (lib_) dlclose(lib_);
  }

  std::string load() override {
    if (lib_) return {};
    lib_ = dlopen(library_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib_) {
      const char* e = dlerror();
      return e ? std::string(e) : library_ + ": cannot be loaded";
    }
    std::string missing;
    auto need = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib_, name));
      if (!fn) missing += missing.empty() ? name : std::string(", ") + name;
    };
    need(init_, "nvmlInit_v2");
    need(shutdown_, "nvmlShutdown");
    need(count_, "nvmlDeviceGetCount_v2");
    need(by_index_, "nvmlDeviceGetHandleByIndex_v2");
    need(by_bus_, "nvmlDeviceGetHandleByPciBusId_v2");
    need(memory_, "nvmlDeviceGetMemoryInfo");
    need(util_, "nvmlDeviceGetUtilizationRates");
    need(power_, "nvmlDeviceGetPowerUsage");
    need(clock_, "nvmlDeviceGetClockInfo");
    need(temp_, "nvmlDeviceGetTemperature");
    need(error_string_, "nvmlErrorString");
    // Optional: drivers before R510 lack it.
    memory_v2_ = reinterpret_cast<decltype(memory_v2_)>(dlsym(lib_, "nvmlDeviceGetMemoryInfo_v2"));
    if (!missing.empty()) {
      dlclose(lib_);
      lib_ = nullptr;
      return library_ + " lacks " + missing;
    }
    return {};
  }

  Return init() override { return lib_ ? init_() : nvml::kErrorUninitialized; }
  Return shutdown() override { return lib_ ? shutdown_() : nvml::kErrorUninitialized; }
  Return device_count(unsigned int* n) override { return lib_ ? count_(n) : nvml::kErrorUninitialized; }
  Return handle_by_index(unsigned int i, DeviceHandle* h) override {
    return lib_ ? by_index_(i, h) : nvml::kErrorUninitialized;
  }
  Return handle_by_pci_bus_id(const char* id, DeviceHandle* h) override {
    return lib_ ? by_bus_(id, h) : nvml::kErrorUninitialized;
  }
  Return memory_info(DeviceHandle h, nvml::Memory* m) override {
    return lib_ ? memory_(h, m) : nvml::kErrorUninitialized;
  }
  Return memory_info_v2(DeviceHandle h, nvml::MemoryV2* m) override {
    if (!lib_) return nvml::kErrorUninitialized;
    return memory_v2_ ? memory_v2_(h, m) : nvml::kErrorFunctionNotFound;
  }
  Return utilization(DeviceHandle h, nvml::Utilization* u) override {
    return lib_ ? util_(h, u) : nvml::kErrorUninitialized;
  }
  Return power_usage(DeviceHandle h, unsigned int* mw) override {
    return lib_ ? power_(h, mw) : nvml::kErrorUninitialized;
  }
  Return clock_info(DeviceHandle h, int type, unsigned int* mhz) override {
    return lib_ ? clock_(h, type, mhz) : nvml::kErrorUninitialized;
  }
  Return temperature(DeviceHandle h, int sensor, unsigned int* c) override {
    return lib_ ? temp_(h, sensor, c) : nvml::kErrorUninitialized;
  }
  std::string error_string(Return r) override {
    const char* s = lib_ ? error_string_(r) : nullptr;
    return s ? std::string(s) : "NVML error " + std::to_string(r);
  }

 private:
  std::string library_;
  void* lib_ = nullptr;
  // Enums of nvml.h (nvmlClockType_t, nvmlTemperatureSensors_t, nvmlReturn_t) are int-sized.
  Return (*init_)() = nullptr;
  Return (*shutdown_)() = nullptr;
  Return (*count_)(unsigned int*) = nullptr;
  Return (*by_index_)(unsigned int, DeviceHandle*) = nullptr;
  Return (*by_bus_)(const char*, DeviceHandle*) = nullptr;
  Return (*memory_)(DeviceHandle, nvml::Memory*) = nullptr;
  Return (*memory_v2_)(DeviceHandle, nvml::MemoryV2*) = nullptr;
  Return (*util_)(DeviceHandle, nvml::Utilization*) = nullptr;
  Return (*power_)(DeviceHandle, unsigned int*) = nullptr;
  Return (*clock_)(DeviceHandle, int, unsigned int*) = nullptr;
  Return (*temp_)(DeviceHandle, int, unsigned int*) = nullptr;
  const char* (*error_string_)(Return) = nullptr;
};

}  // namespace

std::unique_ptr<NvmlApi> make_nvml_api(std::string library) {
  return std::make_unique<DlopenNvml>(std::move(library));
}

NvmlReader::NvmlReader(std::unique_ptr<NvmlApi> api) : api_(std::move(api)) {
  KILN_CHECK(api_ != nullptr, "telemetry: NvmlReader needs an NvmlApi");
}

NvmlReader::~NvmlReader() {
  if (ok_) api_->shutdown();
}

std::string NvmlReader::describe(Return r) {
  return api_->error_string(r) + " (NVML error " + std::to_string(r) + ")";
}

bool NvmlReader::available() {
  if (tried_) return ok_;
  tried_ = true;
  std::string why = api_->load();
  if (!why.empty()) {
    reason_ = "NVML not loaded: " + why;
    return false;
  }
  Return r = api_->init();
  if (r != nvml::kSuccess) {
    reason_ = "nvmlInit_v2 failed: " + describe(r);
    return false;
  }
  ok_ = true;
  return true;
}

int NvmlReader::device_count() {
  if (!available()) return 0;
  unsigned int n = 0;
  return api_->device_count(&n) == nvml::kSuccess ? static_cast<int>(n) : 0;
}

DeviceHandle NvmlReader::handle(const Device& device, const std::string& pci_bus_id) {
  std::string key = pci_bus_id;
  if (key.empty()) key.append("#").append(std::to_string(device.index));  // (not "#" + ...: GCC 12 -Wrestrict)
  if (auto it = handles_.find(key); it != handles_.end()) return it->second;
  DeviceHandle h = nullptr;
  if (!pci_bus_id.empty()) {
    Return r = api_->handle_by_pci_bus_id(pci_bus_id.c_str(), &h);
    KILN_CHECK(r == nvml::kSuccess, "telemetry: ", device.str(), ": NVML has no GPU at PCI bus id ",
               pci_bus_id, ": ", describe(r));
  } else {
    unsigned int n = 0;
    Return r = api_->device_count(&n);
    KILN_CHECK(r == nvml::kSuccess, "telemetry: ", device.str(), ": nvmlDeviceGetCount_v2 failed: ", describe(r));
    KILN_CHECK(device.index >= 0 && static_cast<unsigned int>(device.index) < n, "telemetry: device ",
               device.str(), " out of range: NVML sees ", n, " GPU(s)");
    r = api_->handle_by_index(static_cast<unsigned int>(device.index), &h);
    KILN_CHECK(r == nvml::kSuccess, "telemetry: ", device.str(), ": nvmlDeviceGetHandleByIndex_v2 failed: ",
               describe(r));
  }
  handles_[key] = h;
  return h;
}

void NvmlReader::read(const Device& device, Sample& s, const std::string& pci_bus_id) {
  if (!available()) {
    s.notes.push_back(reason_);
    return;
  }
  DeviceHandle h = handle(device, pci_bus_id);
  auto note = [&](const char* field, Return r) { s.notes.push_back(std::string(field) + ": " + describe(r)); };

  nvml::MemoryV2 m2{};
  m2.version = nvml::kMemoryV2Version;
  Return r = api_->memory_info_v2(h, &m2);
  if (r == nvml::kSuccess) {
    s.memory_total_bytes = static_cast<int64_t>(m2.total);
    s.memory_used_bytes = static_cast<int64_t>(m2.used);
  } else {
    // Older drivers (no _v2, or a version mismatch): v1, whose `used` includes reserved memory.
    nvml::Memory m1{};
    Return r1 = api_->memory_info(h, &m1);
    if (r1 == nvml::kSuccess) {
      s.memory_total_bytes = static_cast<int64_t>(m1.total);
      s.memory_used_bytes = static_cast<int64_t>(m1.used);
    } else {
      note("memory_used_bytes, memory_total_bytes", r1);
    }
  }
  nvml::Utilization u{};
  if ((r = api_->utilization(h, &u)) == nvml::kSuccess) {
    s.utilization_pct = u.gpu;
    s.mem_utilization_pct = u.memory;
  } else {
    note("utilization_pct, mem_utilization_pct", r);
  }
  unsigned int v = 0;
  if ((r = api_->power_usage(h, &v)) == nvml::kSuccess)
    s.power_w = v / 1000.0;
  else
    note("power_w", r);
  if ((r = api_->clock_info(h, nvml::kClockSm, &v)) == nvml::kSuccess)
    s.sm_clock_mhz = v;
  else
    note("sm_clock_mhz", r);
  if ((r = api_->clock_info(h, nvml::kClockMem, &v)) == nvml::kSuccess)
    s.mem_clock_mhz = v;
  else
    note("mem_clock_mhz", r);
  if ((r = api_->temperature(h, nvml::kTemperatureGpu, &v)) == nvml::kSuccess)
    s.temperature_c = v;
  else
    note("temperature_c", r);
}

}  // namespace kiln::telemetry
