// Host (CPU) telemetry from Linux's /proc and /sys, every path taken under a root directory so
// tests can point at committed sample trees (tests/telemetry/data/). The parsers take text and
// return values; HostReader finds the sensors once, then reads them and keeps the previous
// counters so rates (utilization, RAPL power) are averages over the interval between reads.
//
//   memory      /proc/meminfo: MemTotal, MemAvailable (used = total - available)
//   rss         /proc/self/status: VmRSS
//   utilization /proc/stat, first line: busy = user+nice+system+irq+softirq+steal,
//               total = busy + idle + iowait (guest time is already inside user and nice)
//   clock       /sys/devices/system/cpu/cpuN/cpufreq/scaling_cur_freq (kHz), mean over CPUs;
//               without cpufreq (virtual machines), the mean "cpu MHz" of /proc/cpuinfo
//   temperature /sys/class/thermal/thermal_zone*/temp of type x86_pkg_temp; else hwmon
//               coretemp / k10temp / zenpower temp1_input; else a thermal zone whose type names
//               the CPU (cpu, soc, pkg); millidegrees C
//   power       /sys/class/powercap/intel-rapl:N/energy_uj (every package N, also on AMD),
//               wrapping at max_energy_range_uj; most kernels let only root read it
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::telemetry {

struct Sample;

// Parsers (exposed for tests).
struct MemInfo {
  std::optional<int64_t> total_bytes;
  std::optional<int64_t> available_bytes;
};
MemInfo parse_meminfo(std::string_view text);
// VmRSS of a /proc/<pid>/status text, in bytes.
std::optional<int64_t> parse_vmrss(std::string_view status_text);
// Cumulative CPU time of the aggregate "cpu" line of /proc/stat, in clock ticks.
struct CpuTimes {
  uint64_t busy = 0;
  uint64_t total = 0;
};
std::optional<CpuTimes> parse_proc_stat(std::string_view text);
// Busy percentage between two readings (absent when no tick passed or the counters went back).
std::optional<double> cpu_utilization_pct(const CpuTimes& before, const CpuTimes& after);
// Mean of the "cpu MHz" lines of /proc/cpuinfo.
std::optional<double> parse_cpuinfo_mhz(std::string_view text);

// Reads a whole file (also /proc files, whose size reads as 0). Absent when it cannot be read.
std::optional<std::string> read_text_file(const std::string& path);

class HostReader {
 public:
  explicit HostReader(std::string root = "/");

  // Fills the host fields of `s` (memory, rss, utilization, clock, temperature, power). Rates
  // cover [previous read or prime, now_s]; the first read without a prime leaves them absent.
  void read(Sample& s, double now_s);
  // Takes the counters that rates start from, without filling a sample.
  void prime(double now_s);
  // Monotonic time of the previous read or prime (absent before the first).
  std::optional<double> last_time() const { return last_time_; }

  // What the constructor found (for docs and tests): paths, empty when absent.
  const std::vector<std::string>& temperature_paths() const { return temperature_paths_; }
  const std::vector<std::string>& cpufreq_paths() const { return cpufreq_paths_; }
  size_t rapl_package_count() const { return rapl_.size(); }

 private:
  struct Rapl {
    std::string dir;  // .../powercap/intel-rapl:N
    uint64_t max_range_uj = 0;  // 0 when unknown (then a wrap leaves power absent)
    std::optional<uint64_t> last_uj;
  };
  std::string path(std::string_view rel) const { return root_ + std::string(rel); }
  void find_temperature();
  void find_cpufreq();
  void find_rapl();
  std::optional<CpuTimes> read_cpu_times() const;
  // Package power over [last_time_, now_s], updating the energy counters; notes say why absent.
  std::optional<double> read_rapl_power(double now_s, std::vector<std::string>* notes);

  std::string root_;  // ends with '/'
  std::vector<std::string> temperature_paths_;  // the hottest is reported
  std::vector<std::string> cpufreq_paths_;
  std::vector<Rapl> rapl_;
  std::optional<CpuTimes> last_cpu_;
  std::optional<double> last_time_;
};

}  // namespace kiln::telemetry
