// `kiln bench <case> [options]`: a table of benchmark cases, each in cli/bench_<case>.cpp,
// printing one JSON line per measured implementation on stdout and a human table on stderr
// (format in ARCHITECTURE.md "Benchmarks"); and the helpers those cases share.
#include "cli/bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "kiln/core/error.h"
#include "kiln/core/stream.h"

namespace kiln::cli {
namespace {

struct BenchCase {
  const char* name;
  const char* summary;
  int (*run)(const Args& args);
};

constexpr BenchCase kBenchCases[] = {
    {"lce", "fused linear + cross-entropy vs the unfused reference (forward + backward)", run_bench_lce},
    {"attention", "flex_attention vs the dense reference (forward, or forward + backward)", run_bench_attention},
    {"comms", "collective bandwidth under kiln launch (algbw / busbw as nccl-tests)", run_bench_comms},
    {"gemm", "kiln's Hopper GEMM vs cuBLASLt on one shape, layout and epilogue", run_bench_gemm},
    {"jit", "the JIT's cold compile (alone and in the parallel pool) and warm start of run-time mods", run_bench_jit},
};

void print_bench_usage() {
  std::printf("usage: kiln bench <case> [options]   (kiln bench <case> --help for its options)\n\ncases:\n");
  for (const auto& c : kBenchCases) std::printf("  %-12s %s\n", c.name, c.summary);
}

}  // namespace

double bench_time_ms(const Device& device, const std::function<void()>& f) {
  if (!device.is_cpu()) {  // device time: timing events around f on the current stream
    const Stream s = current_stream(device);
    Event start(/*timing=*/true), stop(/*timing=*/true);
    start.record(s);
    f();
    stop.record(s);
    stop.synchronize();
    return start.elapsed_ms(stop);
  }
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

void print_record(const json::Value& record) {
  std::printf("%s\n", record.dump().c_str());
  std::fflush(stdout);
}

std::vector<std::string> parse_impls(const std::string& list, const std::vector<std::string>& known,
                                     const char* bench) {
  std::string names;
  for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= list.size()) {
    const size_t comma = list.find(',', pos);
    const std::string impl = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? list.size() + 1 : comma + 1;
    KILN_CHECK(std::find(known.begin(), known.end(), impl) != known.end(), bench, ": unknown impl '", impl,
               "' in --impl '", list, "' (expected a comma-separated list of ", names, ")");
    if (std::find(out.begin(), out.end(), impl) == out.end()) out.push_back(impl);
  }
  return out;
}

int run_bench(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    print_bench_usage();
    return args.empty() ? 2 : 0;
  }
  for (const auto& c : kBenchCases)
    if (args[0] == c.name) return c.run(Args(args.begin() + 1, args.end()));
  std::fprintf(stderr, "kiln bench: unknown case '%s'\n", args[0].c_str());
  print_bench_usage();
  return 2;
}

}  // namespace kiln::cli
