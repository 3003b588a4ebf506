// Benchmark: safetensors load from the page cache into CPU tensors. For each file given:
// open (header parse + mmap, no data read), zero-copy views (load_safetensors), and owned
// copies (load_safetensors + materialize). One JSON object per case on stdout (ARCHITECTURE.md's
// benchmark format), a short table on stderr. scripts/bench_safetensors.py makes the files,
// warms the page cache and runs Python safetensors' load_file on the same files as the peer.
//   bench_safetensors_load [--repeat N] FILE...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "kiln/core/allocator.h"
#include "kiln/io/json.h"
#include "kiln/io/safetensors.h"

using namespace kiln;

namespace {

template <class F>
double median_ms(int repeat, F&& f) {
  std::vector<double> ms;
  f();  // warm-up
  for (int r = 0; r < repeat; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void report(const std::string& impl, const std::string& file, uint64_t bytes, double ms, int64_t peak) {
  json::Value o = json::Value::object();
  o["bench"] = "safetensors_load";
  o["impl"] = impl;
  o["device"] = "cpu";
  o["shape"] = file;
  o["file_bytes"] = bytes;
  o["dtype"] = "f32";
  o["ms_median"] = ms;
  o["peak_bytes"] = peak;
  o["gb_per_s"] = static_cast<double>(bytes) / (ms * 1e6);
  std::printf("%s\n", o.dump().c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "%-24s %12llu B %10.3f ms %8.2f GB/s\n", impl.c_str(), static_cast<unsigned long long>(bytes), ms,
               static_cast<double>(bytes) / (ms * 1e6));
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 5;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--repeat" && i + 1 < argc) repeat = std::max(1, std::atoi(argv[++i]));
    else files.push_back(a);
  }
  if (files.empty()) {
    std::fprintf(stderr, "usage: bench_safetensors_load [--repeat N] FILE...\n");
    return 2;
  }
  try {
    for (const auto& f : files) {
      const uint64_t bytes = io::SafetensorsFile::open(f).file_bytes();
      double open_ms = median_ms(repeat * 4, [&] { io::SafetensorsFile::open(f); });
      report("kiln_open", f, bytes, open_ms, 0);
      reset_peak_memory_stats(kCPU);
      double view_ms = median_ms(repeat, [&] {
        io::TensorMap t = io::load_safetensors(f);
        // touch nothing: views only
      });
      report("kiln_views", f, bytes, view_ms, memory_stats(kCPU).peak_bytes);
      reset_peak_memory_stats(kCPU);
      const int64_t base = memory_stats(kCPU).current_bytes;
      double own_ms = median_ms(repeat, [&] {
        io::TensorMap t = io::load_safetensors(f);
        io::materialize(t);
      });
      report("kiln_materialize", f, bytes, own_ms, memory_stats(kCPU).peak_bytes - base);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_safetensors_load: %s\n", e.what());
    return 1;
  }
  return 0;
}
