// Device telemetry: one Sample per device — memory used and total, utilization, power, clocks,
// temperature, each a std::optional (absent = the platform cannot say; never a made-up number),
// plus kiln's own allocator figures. A Sampler keeps the previous readings that the rates need
// (CPU utilization and RAPL power are averages over the interval between two samples) and the
// NVML session for GPUs. Sources: kiln/telemetry/host.h (/proc, /sys) and nvml.h (NVML loaded
// at run time). The user guide is docs/telemetry.md.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/device.h"
#include "kiln/io/json.h"
#include "kiln/telemetry/nvml.h"

namespace kiln::telemetry {

struct Sample {
  Device device;
  double time = 0;  // when it was taken: seconds since the Unix epoch (UTC), millisecond resolution

  // The fields of the issue (JSON names are the member names).
  std::optional<int64_t> memory_used_bytes;   // CPU: MemTotal - MemAvailable; GPU: NVML used
  std::optional<int64_t> memory_total_bytes;  // CPU: MemTotal; GPU: NVML total
  std::optional<double> utilization_pct;      // CPU: busy share of all CPUs over the interval
                                              // GPU: NVML's kernel-active share of its sample period
  std::optional<double> power_w;              // CPU: RAPL packages over the interval; GPU: board draw
  std::optional<double> sm_clock_mhz;         // GPU only
  std::optional<double> mem_clock_mhz;        // GPU only
  std::optional<double> temperature_c;        // CPU: package sensor; GPU: die

  // Device-kind extras.
  std::optional<double> cpu_clock_mhz;          // CPU only: mean current frequency of all CPUs
  std::optional<int64_t> process_rss_bytes;     // CPU only: this process's resident set (VmRSS)
  std::optional<double> mem_utilization_pct;    // GPU only: memory-controller busy share

  // kiln's own allocator for this device (kiln::memory_stats), in this process.
  int64_t kiln_current_bytes = 0;
  int64_t kiln_peak_bytes = 0;

  // Why some fields are absent, where the source said so ("power_w: NVML: Not Supported").
  std::vector<std::string> notes;
};

// One JSON object: "device" (string), "time" (number), then every field that applies to the
// device's kind — null when absent (the nine fields on every device, cpu_clock_mhz and
// process_rss_bytes on CPUs, mem_utilization_pct on GPUs), kiln_current_bytes and
// kiln_peak_bytes, and "notes" (array of strings) only when there are notes.
json::Value to_json(const Sample& s);

// A short memory text for progress bars, in GiB with one decimal and '-' for an absent figure:
// "mem 3.2/23.5 GiB, kiln 0.4 GiB (peak 0.9)".
std::string memory_text(const Sample& s);

class HostReader;

class Sampler {
 public:
  struct Options {
    // Where /proc and /sys are looked for ("/" on a live system; a sample tree in tests).
    std::string root = "/";
    // Rates are never measured over less than this: a sample() sooner after the previous
    // reading of this Sampler (the first call just after construction, or polling faster than
    // 10 Hz) sleeps for the rest of it. 0 disables the wait.
    double min_interval_s = 0.1;
    // Monotonic seconds for the intervals (steady_clock when empty; tests inject a fake one).
    std::function<double()> clock;
    // The NVML entry points (the real library, loaded at the first GPU sample, when empty).
    std::unique_ptr<NvmlApi> nvml;
  };

  Sampler();
  explicit Sampler(Options options);
  ~Sampler();
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  // Reads `device` now. CPU: < 1 ms once the interval has passed (see min_interval_s).
  // CUDA: throws kiln::Error naming the device when this build or machine has no such device
  // (kiln::check_device_available); NVML missing or failing leaves the NVML fields absent,
  // with a note saying why. Thread-safe.
  Sample sample(const Device& device);

 private:
  NvmlReader& nvml();
  double now() const;

  std::mutex mu_;
  Options opt_;
  std::unique_ptr<HostReader> host_;
  std::unique_ptr<NvmlReader> nvml_;
};

// sample(device) through a process-wide Sampler (created on first use), so that rates have a
// previous reading and NVML is initialised once.
Sample sample(const Device& device);

// Every device this process can sample: cpu, then cuda:0 .. cuda:N-1 (N = cuda_device_count()).
std::vector<Device> all_devices();

}  // namespace kiln::telemetry
