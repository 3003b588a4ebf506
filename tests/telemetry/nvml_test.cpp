// NVML tests: the failure paths through a mock NvmlApi (library missing, init failing, one query
// failing, index out of range, old drivers without nvmlDeviceGetMemoryInfo_v2), the real dlopen
// path with a library that does not exist, and a real GPU sample where NVML and a GPU are
// present (compared with nvidia-smi when it is on the PATH); it skips, saying why, elsewhere.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/telemetry/nvml.h"
#include "kiln/telemetry/telemetry.h"
#include "tests/skip.h"

using namespace kiln;
using namespace kiln::telemetry;

namespace {

// What the mock answers and what it was asked.
struct MockState {
  std::string load_error;
  nvml::Return init_result = nvml::kSuccess;
  unsigned int count = 2;
  std::map<std::string, unsigned int> bus_ids = {{"00000000:18:00.0", 1}};
  nvml::Return memory_v2_result = nvml::kSuccess;
  nvml::Return memory_result = nvml::kSuccess;
  nvml::Return util_result = nvml::kSuccess;
  nvml::Return power_result = nvml::kSuccess;
  nvml::Return sm_clock_result = nvml::kSuccess;
  nvml::Return mem_clock_result = nvml::kSuccess;
  nvml::Return temp_result = nvml::kSuccess;
  int loads = 0, inits = 0, shutdowns = 0, handle_calls = 0;
  std::vector<int> clock_types, sensors;
};

// GPU i answers values derived from i, so a wrong device shows.
class MockNvml final : public NvmlApi {
 public:
  explicit MockNvml(MockState* st) : st_(st) {}
  static nvml::DeviceHandle handle_of(unsigned int i) {
    return reinterpret_cast<nvml::DeviceHandle>(static_cast<uintptr_t>(0x1000 + i));
  }
  static unsigned int index_of(nvml::DeviceHandle h) {
    return static_cast<unsigned int>(reinterpret_cast<uintptr_t>(h) - 0x1000);
  }
  std::string load() override {
    ++st_->loads;
    return st_->load_error;
  }
  nvml::Return init() override {
    ++st_->inits;
    return st_->init_result;
  }
  nvml::Return shutdown() override {
    ++st_->shutdowns;
    return nvml::kSuccess;
  }
  nvml::Return device_count(unsigned int* n) override {
    *n = st_->count;
    return nvml::kSuccess;
  }
  nvml::Return handle_by_index(unsigned int i, nvml::DeviceHandle* h) override {
    ++st_->handle_calls;
    if (i >= st_->count) return nvml::kErrorInvalidArgument;
    *h = handle_of(i);
    return nvml::kSuccess;
  }
  nvml::Return handle_by_pci_bus_id(const char* id, nvml::DeviceHandle* h) override {
    ++st_->handle_calls;
    auto it = st_->bus_ids.find(id);
    if (it == st_->bus_ids.end()) return nvml::kErrorNotFound;
    *h = handle_of(it->second);
    return nvml::kSuccess;
  }
  nvml::Return memory_info(nvml::DeviceHandle h, nvml::Memory* m) override {
    if (st_->memory_result != nvml::kSuccess) return st_->memory_result;
    m->total = 80ull << 30;
    m->used = (1ull << 30) + index_of(h) + 500;  // v1 includes reserved memory
    m->free = m->total - m->used;
    return nvml::kSuccess;
  }
  nvml::Return memory_info_v2(nvml::DeviceHandle h, nvml::MemoryV2* m) override {
    if (st_->memory_v2_result != nvml::kSuccess) return st_->memory_v2_result;
    EXPECT_EQ(m->version, 0x02000028u);  // NVML_STRUCT_VERSION(Memory, 2) on LP64
    m->total = 80ull << 30;
    m->reserved = 500;
    m->used = (1ull << 30) + index_of(h);
    m->free = m->total - m->used - m->reserved;
    return nvml::kSuccess;
  }
  nvml::Return utilization(nvml::DeviceHandle h, nvml::Utilization* u) override {
    if (st_->util_result != nvml::kSuccess) return st_->util_result;
    u->gpu = 90 + index_of(h);
    u->memory = 40 + index_of(h);
    return nvml::kSuccess;
  }
  nvml::Return power_usage(nvml::DeviceHandle h, unsigned int* mw) override {
    if (st_->power_result != nvml::kSuccess) return st_->power_result;
    *mw = 312345 + index_of(h);
    return nvml::kSuccess;
  }
  nvml::Return clock_info(nvml::DeviceHandle h, int type, unsigned int* mhz) override {
    st_->clock_types.push_back(type);
    if (type == nvml::kClockSm) {
      if (st_->sm_clock_result != nvml::kSuccess) return st_->sm_clock_result;
      *mhz = 1980 - index_of(h);
    } else if (type == nvml::kClockMem) {
      if (st_->mem_clock_result != nvml::kSuccess) return st_->mem_clock_result;
      *mhz = 2619;
    } else {
      return nvml::kErrorInvalidArgument;
    }
    return nvml::kSuccess;
  }
  nvml::Return temperature(nvml::DeviceHandle h, int sensor, unsigned int* c) override {
    st_->sensors.push_back(sensor);
    if (st_->temp_result != nvml::kSuccess) return st_->temp_result;
    *c = 40 + index_of(h);
    return nvml::kSuccess;
  }
  std::string error_string(nvml::Return r) override {
    switch (r) {
      case nvml::kErrorNotSupported: return "Not Supported";
      case nvml::kErrorDriverNotLoaded: return "Driver Not Loaded";
      case nvml::kErrorNotFound: return "Not Found";
      case nvml::kErrorFunctionNotFound: return "Function Not Found";
      case nvml::kErrorGpuIsLost: return "GPU is lost";
      default: return "Unknown Error";
    }
  }

 private:
  MockState* st_;
};

std::unique_ptr<NvmlReader> reader(MockState& st) {
  return std::make_unique<NvmlReader>(std::make_unique<MockNvml>(&st));
}

bool has_note(const Sample& s, const std::string& text) {
  for (const auto& n : s.notes)
    if (n.find(text) != std::string::npos) return true;
  return false;
}

void expect_no_gpu_fields(const Sample& s) {
  EXPECT_FALSE(s.memory_used_bytes);
  EXPECT_FALSE(s.memory_total_bytes);
  EXPECT_FALSE(s.utilization_pct);
  EXPECT_FALSE(s.mem_utilization_pct);
  EXPECT_FALSE(s.power_w);
  EXPECT_FALSE(s.sm_clock_mhz);
  EXPECT_FALSE(s.mem_clock_mhz);
  EXPECT_FALSE(s.temperature_c);
}

}  // namespace

TEST(NvmlMock, ReadsEveryField) {
  MockState st;
  {
    auto r = reader(st);
    Sample s;
    r->read(cuda(1), s);
    EXPECT_EQ(s.memory_total_bytes, int64_t{80} << 30);
    EXPECT_EQ(s.memory_used_bytes, (int64_t{1} << 30) + 1);  // v2: without the reserved bytes
    EXPECT_DOUBLE_EQ(*s.utilization_pct, 91.0);
    EXPECT_DOUBLE_EQ(*s.mem_utilization_pct, 41.0);
    EXPECT_DOUBLE_EQ(*s.power_w, 312.346);  // milliwatts to watts
    EXPECT_DOUBLE_EQ(*s.sm_clock_mhz, 1979.0);
    EXPECT_DOUBLE_EQ(*s.mem_clock_mhz, 2619.0);
    EXPECT_DOUBLE_EQ(*s.temperature_c, 41.0);
    EXPECT_TRUE(s.notes.empty());
    EXPECT_EQ(st.clock_types, (std::vector<int>{1, 2}));  // NVML_CLOCK_SM, NVML_CLOCK_MEM
    EXPECT_EQ(st.sensors, (std::vector<int>{0}));        // NVML_TEMPERATURE_GPU
    EXPECT_EQ(r->device_count(), 2);
    // A second read reuses the session and the handle.
    Sample again;
    r->read(cuda(1), again);
    EXPECT_EQ(st.loads, 1);
    EXPECT_EQ(st.inits, 1);
    EXPECT_EQ(st.handle_calls, 1);
    EXPECT_EQ(st.shutdowns, 0);
  }
  EXPECT_EQ(st.shutdowns, 1);  // the reader's end shuts NVML down
}

TEST(NvmlMock, LibraryMissing) {
  MockState st;
  st.load_error = "libnvidia-ml.so.1: cannot open shared object file: No such file or directory";
  {
    auto r = reader(st);
    EXPECT_FALSE(r->available());
    EXPECT_NE(r->unavailable_reason().find("libnvidia-ml.so.1: cannot open"), std::string::npos);
    EXPECT_EQ(r->device_count(), 0);
    Sample s;
    r->read(cuda(0), s);  // not an error: the platform cannot say
    expect_no_gpu_fields(s);
    EXPECT_TRUE(has_note(s, "NVML not loaded: libnvidia-ml.so.1"));
    r->read(cuda(0), s);
    EXPECT_EQ(st.loads, 1);  // tried once
  }
  EXPECT_EQ(st.inits, 0);
  EXPECT_EQ(st.shutdowns, 0);
}

TEST(NvmlMock, InitFails) {
  MockState st;
  st.init_result = nvml::kErrorDriverNotLoaded;
  {
    auto r = reader(st);
    Sample s;
    r->read(cuda(0), s);
    expect_no_gpu_fields(s);
    EXPECT_TRUE(has_note(s, "nvmlInit_v2 failed: Driver Not Loaded (NVML error 9)"));
    EXPECT_EQ(st.handle_calls, 0);
  }
  EXPECT_EQ(st.inits, 1);
  EXPECT_EQ(st.shutdowns, 0);  // no shutdown without a successful init
}

TEST(NvmlMock, OneQueryFailingLeavesOnlyItsFieldAbsent) {
  MockState st;
  st.power_result = nvml::kErrorNotSupported;
  auto r = reader(st);
  Sample s;
  r->read(cuda(0), s);
  EXPECT_FALSE(s.power_w);
  EXPECT_TRUE(has_note(s, "power_w: Not Supported (NVML error 3)"));
  EXPECT_EQ(s.notes.size(), 1u);
  EXPECT_EQ(s.memory_total_bytes, int64_t{80} << 30);
  EXPECT_DOUBLE_EQ(*s.utilization_pct, 90.0);
  EXPECT_DOUBLE_EQ(*s.sm_clock_mhz, 1980.0);
  EXPECT_DOUBLE_EQ(*s.mem_clock_mhz, 2619.0);
  EXPECT_DOUBLE_EQ(*s.temperature_c, 40.0);
}

TEST(NvmlMock, EachQueryFailingAlone) {
  struct Case {
    nvml::Return MockState::*result;
    const char* note;
  };
  const Case cases[] = {
      {&MockState::util_result, "utilization_pct"},
      {&MockState::sm_clock_result, "sm_clock_mhz"},
      {&MockState::mem_clock_result, "mem_clock_mhz"},
      {&MockState::temp_result, "temperature_c"},
  };
  for (const auto& c : cases) {
    MockState st;
    st.*c.result = nvml::kErrorGpuIsLost;
    auto r = reader(st);
    Sample s;
    r->read(cuda(0), s);
    ASSERT_EQ(s.notes.size(), 1u) << c.note;
    EXPECT_EQ(s.notes[0].rfind(c.note, 0), 0u) << s.notes[0];
    EXPECT_NE(s.notes[0].find("GPU is lost"), std::string::npos);
    int present = s.memory_used_bytes.has_value() + s.utilization_pct.has_value() + s.power_w.has_value() +
                  s.sm_clock_mhz.has_value() + s.mem_clock_mhz.has_value() + s.temperature_c.has_value();
    EXPECT_EQ(present, 5) << c.note;
  }
}

TEST(NvmlMock, OldDriverFallsBackToMemoryV1) {
  MockState st;
  st.memory_v2_result = nvml::kErrorFunctionNotFound;
  auto r = reader(st);
  Sample s;
  r->read(cuda(0), s);
  EXPECT_EQ(s.memory_used_bytes, (int64_t{1} << 30) + 500);  // v1 used
  EXPECT_EQ(s.memory_total_bytes, int64_t{80} << 30);
  EXPECT_TRUE(s.notes.empty());

  MockState both;
  both.memory_v2_result = nvml::kErrorFunctionNotFound;
  both.memory_result = nvml::kErrorNoPermission;
  auto r2 = reader(both);
  Sample s2;
  r2->read(cuda(0), s2);
  EXPECT_FALSE(s2.memory_used_bytes);
  EXPECT_FALSE(s2.memory_total_bytes);
  EXPECT_TRUE(has_note(s2, "memory_used_bytes, memory_total_bytes"));
  EXPECT_TRUE(s2.power_w);
}

TEST(NvmlMock, IndexOutOfRangeNamesTheDevice) {
  MockState st;
  auto r = reader(st);
  Sample s;
  try {
    r->read(cuda(5), s);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("cuda:5"), std::string::npos) << m;
    EXPECT_NE(m.find("2 GPU(s)"), std::string::npos) << m;
  }
  EXPECT_EQ(st.handle_calls, 0);
}

TEST(NvmlMock, FindsTheGpuByPciBusId) {
  MockState st;
  auto r = reader(st);
  Sample s;
  r->read(cuda(0), s, "00000000:18:00.0");  // kiln's cuda:0 is NVML's GPU 1 here
  EXPECT_DOUBLE_EQ(*s.temperature_c, 41.0);
  Sample t;
  try {
    r->read(cuda(3), t, "00000000:AB:00.0");
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("cuda:3"), std::string::npos) << m;
    EXPECT_NE(m.find("00000000:AB:00.0"), std::string::npos) << m;
  }
}

TEST(NvmlMock, SamplerTakesAnInjectedApi) {
  // Sampler::Options::nvml reaches the reader; in a build or on a machine without CUDA the
  // device check comes first and names the device.
  MockState st;
  if (cuda_device_count() > 0) st.bus_ids[cuda_pci_bus_id(0)] = 0;  // how cuda:0 is found
  Sampler::Options o;
  o.nvml = std::make_unique<MockNvml>(&st);
  Sampler sampler(std::move(o));
  if (cuda_device_count() == 0) {
    EXPECT_THROW(sampler.sample(cuda(0)), Error);
    EXPECT_EQ(st.loads, 0);
  } else {
    Sample s = sampler.sample(cuda(0));
    EXPECT_EQ(st.loads, 1);
    EXPECT_DOUBLE_EQ(*s.temperature_c, 40.0);  // the mock's GPU 0
    EXPECT_DOUBLE_EQ(*s.power_w, 312.345);
  }
}

TEST(NvmlDlopen, MissingLibraryIsReported) {
  NvmlReader r(make_nvml_api("libkiln-no-such-nvml.so.1"));
  EXPECT_FALSE(r.available());
  EXPECT_NE(r.unavailable_reason().find("libkiln-no-such-nvml.so.1"), std::string::npos) << r.unavailable_reason();
  Sample s;
  r.read(cuda(0), s);
  expect_no_gpu_fields(s);
  ASSERT_EQ(s.notes.size(), 1u);
}

TEST(NvmlDlopen, CallsBeforeLoadAreRefused) {
  auto api = make_nvml_api("libkiln-no-such-nvml.so.1");
  unsigned int n = 7;
  EXPECT_EQ(api->device_count(&n), nvml::kErrorUninitialized);
  EXPECT_EQ(n, 7u);
  EXPECT_EQ(api->error_string(nvml::kErrorNotSupported), "NVML error 3");
}

// ---- a real GPU, where there is one ----

namespace {

// nvidia-smi's answer for GPU `id` (an NVML index or a PCI bus id), or empty.
std::vector<std::string> nvidia_smi(const std::string& id) {
  std::string cmd =
      "nvidia-smi --query-gpu=memory.total,memory.used,utilization.gpu,power.draw,clocks.sm,clocks.mem,"
      "temperature.gpu --format=csv,noheader,nounits -i " + id + " 2>/dev/null";
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return {};
  char buf[512] = {};
  std::string line = fgets(buf, sizeof buf, f) ? buf : "";
  if (pclose(f) != 0) return {};
  std::vector<std::string> out;
  std::stringstream ss(line);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x.substr(x.find_first_not_of(' ')));
  return out.size() == 7 ? out : std::vector<std::string>{};
}

void compare_with_nvidia_smi(const Sample& s, const std::string& id) {
  std::printf("kiln %s: %s\n", s.device.str().c_str(), to_json(s).dump().c_str());
  auto smi = nvidia_smi(id);
  if (smi.empty()) {
    std::printf("nvidia-smi not available: no comparison\n");
    return;
  }
  std::printf("nvidia-smi -i %s: memory.total %s MiB, memory.used %s MiB, util %s %%, power %s W, "
              "sm %s MHz, mem %s MHz, temp %s C\n",
              id.c_str(), smi[0].c_str(), smi[1].c_str(), smi[2].c_str(), smi[3].c_str(), smi[4].c_str(),
              smi[5].c_str(), smi[6].c_str());
  ASSERT_TRUE(s.memory_total_bytes);
  EXPECT_NEAR(static_cast<double>(*s.memory_total_bytes) / (1 << 20), std::stod(smi[0]), 1.0);
  ASSERT_TRUE(s.temperature_c);
  EXPECT_NEAR(*s.temperature_c, std::stod(smi[6]), 5.0);
  ASSERT_TRUE(s.mem_clock_mhz);
  EXPECT_NEAR(*s.mem_clock_mhz, std::stod(smi[5]), 1.0);  // memory clocks do not move at run time
}

void expect_sane_gpu_sample(const Sample& s) {
  ASSERT_TRUE(s.memory_total_bytes);
  ASSERT_TRUE(s.memory_used_bytes);
  EXPECT_GT(*s.memory_total_bytes, 0);
  EXPECT_GE(*s.memory_used_bytes, 0);
  EXPECT_LE(*s.memory_used_bytes, *s.memory_total_bytes);
  if (s.utilization_pct) {
    EXPECT_LE(*s.utilization_pct, 100.0);
  }
  if (s.power_w) {
    EXPECT_GT(*s.power_w, 0.0);
  }
  if (s.sm_clock_mhz) {
    EXPECT_GT(*s.sm_clock_mhz, 0.0);
  }
  if (s.temperature_c) {
    EXPECT_GT(*s.temperature_c, 0.0);
  }
  for (const auto& n : s.notes) std::printf("note: %s\n", n.c_str());
}

}  // namespace

TEST(RealGpu, NvmlIndexZero) {
  NvmlReader r(make_nvml_api());
  if (!r.available()) GTEST_SKIP() << r.unavailable_reason();
  if (r.device_count() == 0) GTEST_SKIP() << "NVML sees no GPU";
  Sample s;
  s.device = cuda(0);
  r.read(cuda(0), s);
  expect_sane_gpu_sample(s);
  compare_with_nvidia_smi(s, "0");  // nvidia-smi numbers GPUs as NVML does
}

TEST(RealGpu, SamplerCudaZero) {
  KILN_SKIP_WITHOUT_CUDA();
  Sampler sampler;
  Sample s = sampler.sample(cuda(0));
  if (!s.memory_total_bytes && !s.notes.empty()) GTEST_SKIP() << "NVML: " << s.notes[0];
  expect_sane_gpu_sample(s);
  std::string bus = cuda_pci_bus_id(0);
  EXPECT_FALSE(bus.empty());
  compare_with_nvidia_smi(s, bus.empty() ? "0" : bus);
}
