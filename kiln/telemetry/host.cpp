// Host telemetry: parsers of /proc and /sys texts and HostReader, which finds the sensors under
// its root once and reads them (see host.h for which file gives which field).
#include "kiln/telemetry/host.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>

#include "kiln/telemetry/telemetry.h"

namespace kiln::telemetry {
namespace {

namespace fs = std::filesystem;

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Calls f(line) for each line of text.
template <class F>
void for_each_line(std::string_view text, F&& f) {
  while (!text.empty()) {
    size_t nl = text.find('\n');
    f(text.substr(0, nl));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
}

template <class T>
std::optional<T> parse_number(std::string_view s) {
  s = trim(s);
  T v{};
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p == s.data()) return std::nullopt;
  return v;
}

// "   12345 kB" -> bytes (a value without unit is taken as bytes).
std::optional<int64_t> parse_kb_value(std::string_view rest) {
  rest = trim(rest);
  int64_t v = 0;
  auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), v);
  if (ec != std::errc() || p == rest.data() || v < 0) return std::nullopt;
  std::string_view unit = trim(rest.substr(static_cast<size_t>(p - rest.data())));
  if (unit == "kB") return v * 1024;
  if (unit.empty()) return v;
  return std::nullopt;
}

// Value of "Key:" in a "Key: value" text (meminfo, status).
std::optional<int64_t> find_kb(std::string_view text, std::string_view key) {
  std::optional<int64_t> out;
  for_each_line(text, [&](std::string_view line) {
    if (out || line.size() <= key.size() || line.substr(0, key.size()) != key || line[key.size()] != ':')
      return;
    out = parse_kb_value(line.substr(key.size() + 1));
  });
  return out;
}

std::optional<double> read_number_file(const std::string& path) {
  auto text = read_text_file(path);
  if (!text) return std::nullopt;
  return parse_number<double>(*text);
}

// Entries of `dir` whose name starts with `prefix`, sorted by name; empty when unreadable.
std::vector<std::string> list_dir(const std::string& dir, std::string_view prefix) {
  std::vector<std::string> names;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) == 0) names.push_back(std::move(name));
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool readable(const std::string& path) { return ::access(path.c_str(), R_OK) == 0; }

}  // namespace

std::optional<std::string> read_text_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      ::close(fd);
      return std::nullopt;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

MemInfo parse_meminfo(std::string_view text) {
  return MemInfo{find_kb(text, "MemTotal"), find_kb(text, "MemAvailable")};
}

std::optional<int64_t> parse_vmrss(std::string_view status_text) { return find_kb(status_text, "VmRSS"); }

std::optional<CpuTimes> parse_proc_stat(std::string_view text) {
  std::optional<CpuTimes> out;
  for_each_line(text, [&](std::string_view line) {
    if (out || line.substr(0, 4) != "cpu ") return;
    // user nice system idle iowait irq softirq steal guest guest_nice (guest time is already
    // counted in user and nice, so the first eight make the total).
    uint64_t f[8] = {};
    int n = 0;
    std::string_view rest = line.substr(4);
    while (n < 8) {
      rest = trim(rest);
      if (rest.empty()) break;
      auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), f[n]);
      if (ec != std::errc()) return;
      rest.remove_prefix(static_cast<size_t>(p - rest.data()));
      ++n;
    }
    if (n < 4) return;
    CpuTimes t;
    uint64_t idle = f[3] + f[4];
    for (int i = 0; i < 8; ++i) t.total += f[i];
    t.busy = t.total - idle;
    out = t;
  });
  return out;
}

std::optional<double> cpu_utilization_pct(const CpuTimes& before, const CpuTimes& after) {
  if (after.total <= before.total || after.busy < before.busy) return std::nullopt;
  double busy = static_cast<double>(after.busy - before.busy);
  double total = static_cast<double>(after.total - before.total);
  return std::min(100.0, 100.0 * busy / total);
}

std::optional<double> parse_cpuinfo_mhz(std::string_view text) {
  double sum = 0;
  int n = 0;
  for_each_line(text, [&](std::string_view line) {
    if (line.substr(0, 7) != "cpu MHz") return;
    size_t colon = line.find(':');
    if (colon == std::string_view::npos) return;
    if (auto v = parse_number<double>(line.substr(colon + 1)); v && *v > 0) {
      sum += *v;
      ++n;
    }
  });
  if (n == 0) return std::nullopt;
  return sum / n;
}

// ---- HostReader ----

HostReader::HostReader(std::string root) : root_(std::move(root)) {
  if (root_.empty() || root_.back() != '/') root_ += '/';
  find_temperature();
  find_cpufreq();
  find_rapl();
}

void HostReader::find_temperature() {
  // 1. The package sensor of Intel CPUs (one zone per socket; the hottest is reported).
  const std::string thermal = path("sys/class/thermal/");
  std::vector<std::string> cpu_named;
  std::vector<std::string> pkg;
  for (const auto& zone : list_dir(thermal, "thermal_zone")) {
    auto type = read_text_file(thermal + zone + "/type");
    if (!type) continue;
    std::string t(trim(*type));
    std::string temp = thermal + zone + "/temp";
    if (t == "x86_pkg_temp") {
      pkg.push_back(temp);
      continue;
    }
    std::string lower = t;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower.find("cpu") != std::string::npos || lower.find("soc") != std::string::npos ||
        lower.find("pkg") != std::string::npos)
      cpu_named.push_back(temp);
  }
  if (!pkg.empty()) {
    temperature_paths_ = pkg;
    return;
  }
  // 2. The CPU drivers of hwmon: Intel coretemp (temp1 = package), AMD k10temp / zenpower (Tctl).
  const std::string hwmon = path("sys/class/hwmon/");
  for (const auto& h : list_dir(hwmon, "hwmon")) {
    auto name = read_text_file(hwmon + h + "/name");
    if (!name) continue;
    std::string_view n = trim(*name);
    if (n == "coretemp" || n == "k10temp" || n == "zenpower") temperature_paths_.push_back(hwmon + h + "/temp1_input");
  }
  if (!temperature_paths_.empty()) return;
  // 3. A thermal zone whose type names the CPU (Arm boards: cpu-thermal, soc_thermal, ...).
  temperature_paths_ = cpu_named;
}

void HostReader::find_cpufreq() {
  const std::string cpus = path("sys/devices/system/cpu/");
  std::vector<std::pair<int, std::string>> found;
  for (const auto& name : list_dir(cpus, "cpu")) {
    std::string_view num = std::string_view(name).substr(3);
    if (!all_digits(num)) continue;
    std::string f = cpus + name + "/cpufreq/scaling_cur_freq";
    if (readable(f)) found.emplace_back(std::stoi(std::string(num)), f);
  }
  std::sort(found.begin(), found.end());
  for (auto& [i, f] : found) cpufreq_paths_.push_back(std::move(f));
}

void HostReader::find_rapl() {
  // Top-level zones "intel-rapl:N" are the packages; "intel-rapl:N:M" are their sub-zones
  // (core, uncore, dram), already inside the package figure.
  const std::string powercap = path("sys/class/powercap/");
  for (const auto& name : list_dir(powercap, "intel-rapl:")) {
    if (!all_digits(std::string_view(name).substr(11))) continue;
    Rapl r;
    r.dir = powercap + name;
    if (auto max = read_number_file(r.dir + "/max_energy_range_uj"); max && *max > 0)
      r.max_range_uj = static_cast<uint64_t>(*max);
    rapl_.push_back(std::move(r));
  }
}

std::optional<CpuTimes> HostReader::read_cpu_times() const {
  auto text = read_text_file(path("proc/stat"));
  if (!text) return std::nullopt;
  return parse_proc_stat(*text);
}

std::optional<double> HostReader::read_rapl_power(double now_s, std::vector<std::string>* notes) {
  std::optional<double> dt;
  if (last_time_ && now_s > *last_time_) dt = now_s - *last_time_;
  bool complete = dt.has_value() && !rapl_.empty();
  double joules = 0;
  for (auto& r : rapl_) {
    auto text = read_text_file(r.dir + "/energy_uj");
    std::optional<uint64_t> now;
    if (text) now = parse_number<uint64_t>(*text);
    if (!now) {
      complete = false;
      r.last_uj.reset();
      if (notes) notes->push_back("power_w: cannot read " + r.dir + "/energy_uj (RAPL energy is readable by root only on most kernels)");
      continue;
    }
    if (r.last_uj) {
      uint64_t before = *r.last_uj;
      if (*now >= before)
        joules += static_cast<double>(*now - before) * 1e-6;
      else if (r.max_range_uj > before)  // the counter wrapped
        joules += static_cast<double>(r.max_range_uj - before + *now) * 1e-6;
      else
        complete = false;
    } else {
      complete = false;
    }
    r.last_uj = now;
  }
  if (!complete) return std::nullopt;
  return joules / *dt;
}

void HostReader::prime(double now_s) {
  last_cpu_ = read_cpu_times();
  read_rapl_power(now_s, nullptr);
  last_time_ = now_s;
}

void HostReader::read(Sample& s, double now_s) {
  if (auto text = read_text_file(path("proc/meminfo"))) {
    MemInfo m = parse_meminfo(*text);
    s.memory_total_bytes = m.total_bytes;
    if (m.total_bytes && m.available_bytes && *m.available_bytes <= *m.total_bytes)
      s.memory_used_bytes = *m.total_bytes - *m.available_bytes;
  }
  if (auto text = read_text_file(path("proc/self/status"))) s.process_rss_bytes = parse_vmrss(*text);

  std::optional<CpuTimes> cpu = read_cpu_times();
  if (cpu && last_cpu_) s.utilization_pct = cpu_utilization_pct(*last_cpu_, *cpu);
  last_cpu_ = cpu;

  if (!cpufreq_paths_.empty()) {
    double sum = 0;
    int n = 0;
    for (const auto& f : cpufreq_paths_) {
      if (auto khz = read_number_file(f); khz && *khz > 0) {
        sum += *khz / 1000.0;
        ++n;
      }
    }
    if (n > 0) s.cpu_clock_mhz = sum / n;
  } else if (auto text = read_text_file(path("proc/cpuinfo"))) {
    s.cpu_clock_mhz = parse_cpuinfo_mhz(*text);
  }

  for (const auto& f : temperature_paths_) {
    if (auto milli = read_number_file(f)) {
      double c = *milli / 1000.0;
      if (!s.temperature_c || c > *s.temperature_c) s.temperature_c = c;
    }
  }

  s.power_w = read_rapl_power(now_s, &s.notes);
  last_time_ = now_s;
}

}  // namespace kiln::telemetry
