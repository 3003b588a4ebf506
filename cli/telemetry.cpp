// `kiln telemetry [--device cpu|cuda:N|all] [--watch SECONDS] [--count N] [--json]`: device
// telemetry as a live table (header, then one row per sample per device, like
// `nvidia-smi dmon`) or as JSON lines (one object per sample per device; fields in
// docs/telemetry.md). Ctrl-C stops a watch cleanly (exit 0).
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <set>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/telemetry/telemetry.h"

namespace kiln::cli {
namespace {

// NOTE: process-wide, as signal dispositions are; set by the SIGINT handler only.
volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void on_sigint(int) { g_interrupted = 1; }

// Installs on_sigint for SIGINT (without SA_RESTART, so a sleep returns at once) and puts the
// previous disposition back when it goes.
class SigintGuard {
 public:
  SigintGuard() {
    g_interrupted = 0;
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;
    sigaction(SIGINT, &sa, &old_);
  }
  ~SigintGuard() { sigaction(SIGINT, &old_, nullptr); }

 private:
  struct sigaction old_ {};
};

double monotonic_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// Sleeps until monotonic time `deadline`; false when Ctrl-C came first.
bool sleep_until(double deadline) {
  while (!g_interrupted) {
    double left = deadline - monotonic_s();
    if (left <= 0) return true;
    const double step = std::min(left, 3600.0);  // a long --watch sleeps in steps that time_t holds
    timespec ts;
    ts.tv_sec = static_cast<time_t>(step);
    ts.tv_nsec = static_cast<long>((step - static_cast<double>(ts.tv_sec)) * 1e9);
    nanosleep(&ts, nullptr);  // returns early (EINTR) on SIGINT
  }
  return false;
}

constexpr double kMiB = 1024.0 * 1024.0;

std::string cell(const std::optional<double>& v, int precision = 0) {
  if (!v) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", precision, *v);
  return buf;
}
std::string mib(const std::optional<int64_t>& v) {
  if (!v) return "-";
  return cell(static_cast<double>(*v) / kMiB);
}

// One format for the header and the rows, so the columns line up.
constexpr const char* kRowFormat = "%-2s%-8s %-8s %8s %10s %5s %6s %6s %6s %7s %5s %9s %9s %10s\n";

void print_header() {
  std::printf(kRowFormat, "#", "time", "device", "mem_used", "mem_total", "util", "mutil", "power", "clock", "mclock",
              "temp", "rss", "kiln_cur", "kiln_peak");
  std::printf(kRowFormat, "#", "UTC", "", "MiB", "MiB", "%", "%", "W", "MHz", "MHz", "C", "MiB", "MiB", "MiB");
}

void print_row(const telemetry::Sample& s) {
  char when[16] = "-";
  time_t secs = static_cast<time_t>(s.time);
  struct tm utc {};
  if (gmtime_r(&secs, &utc)) std::strftime(when, sizeof when, "%H:%M:%S", &utc);
  std::optional<double> clock = s.device.is_cpu() ? s.cpu_clock_mhz : s.sm_clock_mhz;
  std::printf(kRowFormat, "", when, s.device.str().c_str(),
              mib(s.memory_used_bytes).c_str(), mib(s.memory_total_bytes).c_str(), cell(s.utilization_pct).c_str(),
              cell(s.mem_utilization_pct).c_str(), cell(s.power_w, 1).c_str(), cell(clock).c_str(),
              cell(s.mem_clock_mhz).c_str(), cell(s.temperature_c).c_str(), mib(s.process_rss_bytes).c_str(),
              mib(std::optional<int64_t>(s.kiln_current_bytes)).c_str(),
              mib(std::optional<int64_t>(s.kiln_peak_bytes)).c_str());
}

}  // namespace

int run_telemetry(const Args& args) {
  std::string device_arg = "all";
  double watch = 0;
  int64_t count = 1;
  bool as_json = false;
  ArgParser p("telemetry",
              "Sample device telemetry: memory used and total, utilization, power, clocks and\n"
              "temperature of the CPU (from /proc and /sys) and of each GPU (from NVML), with kiln's\n"
              "own allocator figures. Prints a table (one row per sample per device, '-' where the\n"
              "platform cannot say) or JSON lines.");
  p.option("--device", &device_arg, "DEV", "cpu, cuda:N or all (the CPU and every GPU)");
  p.option("--watch", &watch, "SECONDS", "sample every SECONDS (> 0) until --count samples or Ctrl-C; without it, one sample")
      .without_default();
  p.option("--count", &count, "N", "stop after N samples (unbounded with --watch unless given)");
  p.flag("--json", &as_json, "print one JSON object per sample per device instead of a table");
  p.epilog("examples:\n  kiln telemetry\n  kiln telemetry --device cuda:0 --watch 1\n"
           "  kiln telemetry --json --watch 0.5 --count 20 > telemetry.jsonl");
  if (!p.parse(args)) return 0;

  const bool watching = p.given("--watch");
  KILN_CHECK(!watching || (std::isfinite(watch) && watch > 0), "--watch: expected seconds > 0, got ", watch);
  KILN_CHECK(!p.given("--count") || count >= 1, "--count: expected N >= 1, got ", count);
  const double interval = watching ? watch : 1.0;
  const int64_t samples = p.given("--count") ? count : (watching ? -1 : 1);

  std::vector<Device> devices;
  if (device_arg == "all") {
    devices = telemetry::all_devices();
  } else {
    Device d = Device::parse(device_arg);
    check_device_available(d, "telemetry");
    devices.push_back(d);
  }

  telemetry::Sampler sampler;
  SigintGuard sigint;
  std::set<std::string> noted;
  if (!as_json) {
    print_header();
    std::fflush(stdout);
  }
  const double start = monotonic_s();
  for (int64_t k = 0; samples < 0 || k < samples; ++k) {
    if (k > 0 && !sleep_until(start + static_cast<double>(k) * interval)) break;
    for (const Device& d : devices) {
      telemetry::Sample s = sampler.sample(d);
      if (as_json) {
        std::printf("%s\n", telemetry::to_json(s).dump().c_str());
      } else {
        print_row(s);
        for (const auto& n : s.notes)
          if (noted.insert(d.str() + ": " + n).second)
            std::fprintf(stderr, "kiln telemetry: %s: %s\n", d.str().c_str(), n.c_str());
      }
    }
    std::fflush(stdout);
    if (g_interrupted) break;
  }
  return 0;
}

}  // namespace kiln::cli
