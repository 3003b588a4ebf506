// Host telemetry tests: the parsers and HostReader on the committed /proc and /sys trees of
// tests/telemetry/data/ (exact values), rates between two snapshots with a fake clock, and a
// real sample of this machine.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/ops/ops.h"
#include "kiln/telemetry/host.h"
#include "kiln/telemetry/telemetry.h"

using namespace kiln;
using namespace kiln::telemetry;
namespace fs = std::filesystem;

namespace {

const std::string kData = std::string(KILN_SOURCE_DIR) + "/tests/telemetry/data/";

// A writable copy of data tree `name` in a fresh temporary directory, removed at the end.
class TreeCopy {
 public:
  explicit TreeCopy(const std::string& name) {
    std::string tmpl = (fs::temp_directory_path() / "kiln_telemetry_XXXXXX").string();
    KILN_CHECK(mkdtemp(tmpl.data()) != nullptr, "mkdtemp failed");
    dir_ = tmpl;
    fs::copy(kData + name, dir_, fs::copy_options::recursive);
  }
  ~TreeCopy() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // Copies the files of data tree `name` over this one (the machine's state later on).
  void overlay(const std::string& name) {
    fs::copy(kData + name, dir_, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

// A Sampler on `root` with a clock the test moves.
struct FakeClockSampler {
  double t = 1000.0;
  Sampler sampler;
  explicit FakeClockSampler(const std::string& root)
      : sampler([&] {
          Sampler::Options o;
          o.root = root;
          o.min_interval_s = 0;
          o.clock = [this] { return t; };
          return o;
        }()) {}
};

constexpr int64_t kKiB = 1024;

}  // namespace

TEST(HostParse, Meminfo) {
  auto text = read_text_file(kData + "intel_desktop/proc/meminfo");
  ASSERT_TRUE(text);
  MemInfo m = parse_meminfo(*text);
  EXPECT_EQ(m.total_bytes, 32598484 * kKiB);
  EXPECT_EQ(m.available_bytes, 24171360 * kKiB);
  // Kernels before 3.14 have no MemAvailable; a key that only starts like another is not it.
  MemInfo old = parse_meminfo("MemTotal:  1000 kB\nMemFree:  500 kB\nMemAvailableX: 7 kB\n");
  EXPECT_EQ(old.total_bytes, 1000 * kKiB);
  EXPECT_FALSE(old.available_bytes);
  EXPECT_FALSE(parse_meminfo("").total_bytes);
  EXPECT_FALSE(parse_meminfo("MemTotal: lots kB\n").total_bytes);
  EXPECT_FALSE(parse_meminfo("MemTotal: 12 MB\n").total_bytes);
}

TEST(HostParse, VmRss) {
  auto text = read_text_file(kData + "intel_desktop/proc/self/status");
  ASSERT_TRUE(text);
  EXPECT_EQ(parse_vmrss(*text), 183452 * kKiB);
  EXPECT_FALSE(parse_vmrss("Name:\tkthreadd\nState:\tS (sleeping)\n"));  // kernel threads have none
}

TEST(HostParse, ProcStat) {
  auto text = read_text_file(kData + "intel_desktop/proc/stat");
  ASSERT_TRUE(text);
  auto t = parse_proc_stat(*text);
  ASSERT_TRUE(t);
  // user nice system idle iowait irq softirq steal (guest 100 is inside user already)
  EXPECT_EQ(t->total, 1200000u + 3000 + 400000 + 9000000 + 20000 + 0 + 5000 + 0);
  EXPECT_EQ(t->busy, 1200000u + 3000 + 400000 + 5000);
  // Old kernels: four fields only.
  auto four = parse_proc_stat("cpu  10 20 30 40\ncpu0 10 20 30 40\n");
  ASSERT_TRUE(four);
  EXPECT_EQ(four->total, 100u);
  EXPECT_EQ(four->busy, 60u);
  EXPECT_FALSE(parse_proc_stat("cpu0 1 2 3 4\n"));  // no aggregate line
  EXPECT_FALSE(parse_proc_stat("cpu  1 2 x 4\n"));
  EXPECT_FALSE(parse_proc_stat("cpu  1 2\n"));
}

TEST(HostParse, Utilization) {
  CpuTimes a{100, 1000}, b{340 + 100, 1800};
  EXPECT_DOUBLE_EQ(*cpu_utilization_pct(a, b), 42.5);
  EXPECT_FALSE(cpu_utilization_pct(a, a));  // no tick passed
  EXPECT_FALSE(cpu_utilization_pct(b, a));  // counters went back
}

TEST(HostParse, CpuinfoMhz) {
  auto text = read_text_file(kData + "vm/proc/cpuinfo");
  ASSERT_TRUE(text);
  EXPECT_DOUBLE_EQ(*parse_cpuinfo_mhz(*text), (2445.404 + 2445.406) / 2);
  EXPECT_FALSE(parse_cpuinfo_mhz("processor\t: 0\nBogoMIPS\t: 108.00\n"));  // Arm: no cpu MHz
}

TEST(HostParse, MissingFileIsAbsent) {
  EXPECT_FALSE(read_text_file(kData + "no/such/file"));
  EXPECT_FALSE(read_text_file(kData));  // a directory
}

TEST(HostReader, IntelDesktopFirstRead) {
  HostReader r(kData + "intel_desktop");
  EXPECT_EQ(r.cpufreq_paths().size(), 4u);
  ASSERT_EQ(r.temperature_paths().size(), 1u);
  EXPECT_NE(r.temperature_paths()[0].find("thermal_zone2/temp"), std::string::npos);
  EXPECT_EQ(r.rapl_package_count(), 1u);  // intel-rapl:0 only, not its sub-zones

  Sample s;
  r.read(s, 10.0);
  EXPECT_EQ(s.memory_total_bytes, 32598484 * kKiB);
  EXPECT_EQ(s.memory_used_bytes, (32598484 - 24171360) * kKiB);
  EXPECT_EQ(s.process_rss_bytes, 183452 * kKiB);
  EXPECT_DOUBLE_EQ(*s.cpu_clock_mhz, (3400000 + 2800123 + 800000 + 4699872) / 1000.0 / 4);
  EXPECT_DOUBLE_EQ(*s.temperature_c, 54.0);  // x86_pkg_temp, not acpitz nor coretemp
  // Rates need a previous reading.
  EXPECT_FALSE(s.utilization_pct);
  EXPECT_FALSE(s.power_w);
  // The GPU fields never appear on a CPU.
  EXPECT_FALSE(s.sm_clock_mhz);
  EXPECT_FALSE(s.mem_clock_mhz);
  EXPECT_FALSE(s.mem_utilization_pct);
  EXPECT_TRUE(s.notes.empty());
}

TEST(HostReader, IntelDesktopRatesOverTwoSeconds) {
  TreeCopy tree("intel_desktop");
  FakeClockSampler f(tree.dir());  // primes at t = 1000
  tree.overlay("intel_desktop.later");
  f.t = 1002.0;
  Sample s = f.sampler.sample(kCPU);
  // 800 ticks passed, 340 of them busy (user 250 + nice 10 + system 60 + softirq 20).
  EXPECT_DOUBLE_EQ(*s.utilization_pct, 42.5);
  // package-0 used 70.5 J in 2 s (its sub-zones are not added again).
  EXPECT_DOUBLE_EQ(*s.power_w, 35.25);
  EXPECT_EQ(s.device, kCPU);
  EXPECT_GT(s.time, 1.7e9);  // wall-clock seconds since 1970

  // Nothing moved since: utilization absent (no tick), power 0 W.
  f.t = 1003.0;
  Sample again = f.sampler.sample(kCPU);
  EXPECT_FALSE(again.utilization_pct);
  EXPECT_DOUBLE_EQ(*again.power_w, 0.0);
}

TEST(HostReader, AmdServerHwmonAndRaplWrap) {
  TreeCopy tree("amd_server");
  FakeClockSampler f(tree.dir());
  tree.overlay("amd_server.later");
  f.t = 1000.5;
  Sample s = f.sampler.sample(kCPU);
  EXPECT_EQ(s.memory_total_bytes, 528102744 * kKiB);
  EXPECT_EQ(s.memory_used_bytes, (528102744 - 498877120) * kKiB);
  EXPECT_EQ(s.process_rss_bytes, 2254100 * kKiB);
  EXPECT_DOUBLE_EQ(*s.cpu_clock_mhz, 2600.0);
  EXPECT_DOUBLE_EQ(*s.temperature_c, 63.875);  // hottest k10temp, not the NVMe drive
  // busy: user 300 + system 100 + softirq 40 = 440 of 440 + idle 3560 = 4000 ticks.
  EXPECT_DOUBLE_EQ(*s.utilization_pct, 11.0);
  // package 0 wrapped at max_energy_range_uj: 610987 + 1234567 uJ; package 1: 1000000 uJ.
  EXPECT_DOUBLE_EQ(*s.power_w, (610987.0 + 1234567.0 + 1000000.0) * 1e-6 / 0.5);
}

TEST(HostReader, VirtualMachineHasNoSensors) {
  HostReader r(kData + "vm");
  EXPECT_TRUE(r.cpufreq_paths().empty());
  EXPECT_TRUE(r.temperature_paths().empty());
  EXPECT_EQ(r.rapl_package_count(), 0u);
  r.prime(0.0);
  Sample s;
  r.read(s, 1.0);  // same /proc/stat: no tick passed
  EXPECT_EQ(s.memory_total_bytes, 24683656 * kKiB);
  EXPECT_EQ(s.memory_used_bytes, (24683656 - 21953976) * kKiB);
  EXPECT_EQ(s.process_rss_bytes, 2080 * kKiB);
  EXPECT_DOUBLE_EQ(*s.cpu_clock_mhz, (2445.404 + 2445.406) / 2);  // /proc/cpuinfo fallback
  EXPECT_FALSE(s.temperature_c);
  EXPECT_FALSE(s.power_w);
  EXPECT_FALSE(s.utilization_pct);
}

TEST(HostReader, ArmBoardCpuThermalZone) {
  HostReader r(kData + "arm_board");
  Sample s;
  r.read(s, 0.0);
  EXPECT_DOUBLE_EQ(*s.temperature_c, 47.236);  // cpu-thermal, not gpu-thermal
  EXPECT_DOUBLE_EQ(*s.cpu_clock_mhz, 1800.0);
  EXPECT_EQ(s.memory_used_bytes, (8245360 - 6900100) * kKiB);
}

TEST(HostReader, MissingRootGivesAbsentFields) {
  HostReader r(kData + "does-not-exist");
  r.prime(0.0);
  Sample s;
  r.read(s, 1.0);
  EXPECT_FALSE(s.memory_total_bytes);
  EXPECT_FALSE(s.memory_used_bytes);
  EXPECT_FALSE(s.process_rss_bytes);
  EXPECT_FALSE(s.utilization_pct);
  EXPECT_FALSE(s.cpu_clock_mhz);
  EXPECT_FALSE(s.temperature_c);
  EXPECT_FALSE(s.power_w);
}

TEST(HostReader, UnreadableRaplEnergyIsAbsentWithNote) {
  TreeCopy tree("intel_desktop");
  FakeClockSampler f(tree.dir());
  fs::remove(tree.dir() + "/sys/class/powercap/intel-rapl:0/energy_uj");  // as if root-only
  f.t = 1001.0;
  Sample s = f.sampler.sample(kCPU);
  EXPECT_FALSE(s.power_w);
  ASSERT_EQ(s.notes.size(), 1u);
  EXPECT_NE(s.notes[0].find("power_w: cannot read"), std::string::npos) << s.notes[0];
}

TEST(SampleJson, FieldNamesAndNulls) {
  HostReader r(kData + "intel_desktop");
  Sample s;
  s.device = kCPU;
  s.time = 1764480000.25;
  r.read(s, 0.0);
  s.kiln_current_bytes = 4096;
  s.kiln_peak_bytes = 8192;
  json::Value j = json::parse(to_json(s).dump());
  EXPECT_EQ(j.find("device")->as_string(), "cpu");
  EXPECT_DOUBLE_EQ(j.find("time")->as_double(), 1764480000.25);
  EXPECT_EQ(j.find("memory_used_bytes")->as_int(), (32598484 - 24171360) * kKiB);
  EXPECT_EQ(j.find("memory_total_bytes")->as_int(), 32598484 * kKiB);
  EXPECT_TRUE(j.find("utilization_pct")->is_null());
  EXPECT_TRUE(j.find("power_w")->is_null());
  EXPECT_TRUE(j.find("sm_clock_mhz")->is_null());
  EXPECT_TRUE(j.find("mem_clock_mhz")->is_null());
  EXPECT_DOUBLE_EQ(j.find("temperature_c")->as_double(), 54.0);
  EXPECT_DOUBLE_EQ(j.find("cpu_clock_mhz")->as_double(), *s.cpu_clock_mhz);
  EXPECT_EQ(j.find("process_rss_bytes")->as_int(), 183452 * kKiB);
  EXPECT_EQ(j.find("kiln_current_bytes")->as_int(), 4096);
  EXPECT_EQ(j.find("kiln_peak_bytes")->as_int(), 8192);
  EXPECT_FALSE(j.contains("mem_utilization_pct"));  // GPU only
  EXPECT_FALSE(j.contains("notes"));

  Sample g;
  g.device = cuda(1);
  g.power_w = 123.5;
  g.notes = {"sm_clock_mhz: Not Supported (NVML error 3)"};
  json::Value gj = json::parse(to_json(g).dump());
  EXPECT_EQ(gj.find("device")->as_string(), "cuda:1");
  EXPECT_DOUBLE_EQ(gj.find("power_w")->as_double(), 123.5);
  EXPECT_TRUE(gj.find("mem_utilization_pct")->is_null());
  EXPECT_FALSE(gj.contains("cpu_clock_mhz"));
  EXPECT_FALSE(gj.contains("process_rss_bytes"));
  ASSERT_EQ(gj.find("notes")->size(), 1u);
  EXPECT_EQ(gj.find("notes")->as_array()[0].as_string(), g.notes[0]);
}

TEST(SampleText, Memory) {
  Sample s;
  s.memory_used_bytes = int64_t{3} << 30;
  s.memory_total_bytes = (int64_t{47} << 30) / 2;  // 23.5 GiB
  s.kiln_current_bytes = (int64_t{1} << 30) / 4;
  s.kiln_peak_bytes = int64_t{1} << 30;
  EXPECT_EQ(memory_text(s), "mem 3.0/23.5 GiB, kiln 0.2 GiB (peak 1.0)");
  s.memory_used_bytes.reset();
  EXPECT_EQ(memory_text(s), "mem -/23.5 GiB, kiln 0.2 GiB (peak 1.0)");
}

// ---- this machine ----

TEST(RealHost, CpuSample) {
  Sampler sampler;
  Tensor t = zeros({1000, 100});  // something in kiln's allocator
  Sample s = sampler.sample(kCPU);
  ASSERT_TRUE(s.memory_total_bytes) << "no MemTotal in /proc/meminfo";
  ASSERT_TRUE(s.memory_used_bytes) << "no MemAvailable in /proc/meminfo";
  EXPECT_GT(*s.memory_used_bytes, 0);
  EXPECT_LE(*s.memory_used_bytes, *s.memory_total_bytes);
  ASSERT_TRUE(s.process_rss_bytes);
  EXPECT_GT(*s.process_rss_bytes, 0);
  // The first sample waited for min_interval_s, so at least one tick passed on some CPU.
  ASSERT_TRUE(s.utilization_pct);
  EXPECT_GE(*s.utilization_pct, 0.0);
  EXPECT_LE(*s.utilization_pct, 100.0);
  if (s.cpu_clock_mhz) {
    EXPECT_GT(*s.cpu_clock_mhz, 0.0);
  }
  if (s.power_w) {
    EXPECT_GE(*s.power_w, 0.0);
  }
  EXPECT_GE(s.kiln_current_bytes, t.numel() * 4);
  EXPECT_GE(s.kiln_peak_bytes, s.kiln_current_bytes);
  std::printf("real cpu sample: %s\n", to_json(s).dump().c_str());
}

TEST(RealHost, ProcessWideSampleAndDevices) {
  Sample a = telemetry::sample(kCPU);
  Sample b = telemetry::sample(kCPU);
  EXPECT_GE(b.time, a.time);
  std::vector<Device> all = all_devices();
  ASSERT_GE(all.size(), 1u);
  EXPECT_EQ(all[0], kCPU);
  EXPECT_EQ(static_cast<int>(all.size()), 1 + cuda_device_count());
}

TEST(RealHost, CudaDeviceWithoutCudaIsAnError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has CUDA devices";
  Sampler sampler;
  try {
    sampler.sample(cuda(0));
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
}
