// bench_telemetry: the cost of one Sampler::sample() per device (CPU: /proc and /sys reads;
// GPU: NVML queries), so the trainer can log telemetry often. One JSON object per device on
// stdout, a short table on stderr.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "kiln/io/json.h"
#include "kiln/telemetry/telemetry.h"

int main() {
  using namespace kiln;
  telemetry::Sampler::Options o;
  o.min_interval_s = 0;  // measure the reads, not the rate guard
  telemetry::Sampler sampler(std::move(o));
  for (const Device& d : telemetry::all_devices()) {
    for (int i = 0; i < 20; ++i) sampler.sample(d);  // warm-up (NVML init, page cache)
    std::vector<double> ms;
    for (int i = 0; i < 500; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      telemetry::Sample s = sampler.sample(d);
      auto t1 = std::chrono::steady_clock::now();
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    json::Value r = json::Value::object();
    r["bench"] = "telemetry_sample";
    r["impl"] = "kiln";
    r["device"] = d.str();
    r["shape"] = "";
    r["dtype"] = "";
    r["ms_median"] = ms[ms.size() / 2];
    r["ms_p90"] = ms[ms.size() * 9 / 10];
    r["peak_bytes"] = static_cast<int64_t>(0);
    std::printf("%s\n", r.dump().c_str());
    std::fprintf(stderr, "%-8s sample(): median %.3f ms, p90 %.3f ms\n", d.str().c_str(), ms[ms.size() / 2],
                 ms[ms.size() * 9 / 10]);
  }
  return 0;
}
