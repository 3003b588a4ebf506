// Sampler (host and NVML sources behind one call), the process-wide sample(), and to_json.
#include "kiln/telemetry/telemetry.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/telemetry/host.h"
#include "kiln/telemetry/nvml.h"

namespace kiln::telemetry {
namespace {

double wall_time_s() {
  using namespace std::chrono;
  auto ms = duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
  return static_cast<double>(ms) / 1000.0;
}

double steady_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

template <class T>
json::Value opt(const std::optional<T>& v) {
  return v ? json::Value(*v) : json::Value(nullptr);
}

}  // namespace

json::Value to_json(const Sample& s) {
  json::Value o = json::Value::object();
  o["device"] = s.device.str();
  o["time"] = s.time;
  o["memory_used_bytes"] = opt(s.memory_used_bytes);
  o["memory_total_bytes"] = opt(s.memory_total_bytes);
  o["utilization_pct"] = opt(s.utilization_pct);
  o["power_w"] = opt(s.power_w);
  o["sm_clock_mhz"] = opt(s.sm_clock_mhz);
  o["mem_clock_mhz"] = opt(s.mem_clock_mhz);
  o["temperature_c"] = opt(s.temperature_c);
  if (s.device.is_cpu()) {
    o["cpu_clock_mhz"] = opt(s.cpu_clock_mhz);
    o["process_rss_bytes"] = opt(s.process_rss_bytes);
  } else {
    o["mem_utilization_pct"] = opt(s.mem_utilization_pct);
  }
  o["kiln_current_bytes"] = s.kiln_current_bytes;
  o["kiln_peak_bytes"] = s.kiln_peak_bytes;
  if (!s.notes.empty()) {
    json::Value notes = json::Value::array();
    for (const auto& n : s.notes) notes.push_back(n);
    o["notes"] = std::move(notes);
  }
  return o;
}

std::string memory_text(const Sample& s) {
  auto gib = [](std::optional<int64_t> b) {
    if (!b) return std::string("-");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(*b) / (1024.0 * 1024.0 * 1024.0));
    return std::string(buf);
  };
  return "mem " + gib(s.memory_used_bytes) + "/" + gib(s.memory_total_bytes) + " GiB, kiln " +
         gib(s.kiln_current_bytes) + " GiB (peak " + gib(s.kiln_peak_bytes) + ")";
}

Sampler::Sampler() : Sampler(Options{}) {}

Sampler::Sampler(Options options) : opt_(std::move(options)) {
  host_ = std::make_unique<HostReader>(opt_.root);
  host_->prime(now());
}

Sampler::~Sampler() = default;

double Sampler::now() const { return opt_.clock ? opt_.clock() : steady_s(); }

NvmlReader& Sampler::nvml() {
  if (!nvml_) nvml_ = std::make_unique<NvmlReader>(opt_.nvml ? std::move(opt_.nvml) : make_nvml_api());
  return *nvml_;
}

Sample Sampler::sample(const Device& device) {
  std::lock_guard<std::mutex> lock(mu_);
  Sample s;
  s.device = device;
  if (device.is_cuda()) {
    check_device_available(device, "telemetry");
    nvml().read(device, s, cuda_pci_bus_id(device.index));
  } else {
    double t = now();
    if (auto last = host_->last_time(); last && opt_.min_interval_s > 0 && t - *last < opt_.min_interval_s) {
      std::this_thread::sleep_for(std::chrono::duration<double>(opt_.min_interval_s - (t - *last)));
      t = now();
    }
    host_->read(s, t);
  }
  MemoryStats m = memory_stats(device);
  s.kiln_current_bytes = m.current_bytes;
  s.kiln_peak_bytes = m.peak_bytes;
  s.time = wall_time_s();
  return s;
}

Sample sample(const Device& device) {
  // NOTE: process-wide, so that rates have a previous reading and NVML is initialised once.
  static Sampler sampler;
  return sampler.sample(device);
}

std::vector<Device> all_devices() {
  std::vector<Device> out{kCPU};
  int n = cuda_device_count();
  for (int i = 0; i < n; ++i) out.push_back(cuda(i));
  return out;
}

}  // namespace kiln::telemetry
