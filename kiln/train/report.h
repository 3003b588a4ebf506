// What a training run shows: the progress line on stderr (redrawn in place on a terminal,
// plain lines otherwise), the metrics log (JSON lines), the loss curve as an SVG file, and the
// op-level profile as JSON (profile.json).
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/profile.h"
#include "kiln/io/json.h"

namespace kiln::train {

class Progress {
 public:
  // On a terminal, one line redrawn in place within its width (evaluations stay). Elsewhere (a
  // log file), a line every `every` steps but at most one per 2 s, plus evaluations and the end.
  Progress(FILE* out, int64_t total_steps, int64_t every);
  void update(int64_t step, double loss, double tokens_per_s, double eta_s, int64_t mem_bytes,
              double eval_loss = -1);
  // Prints a message on its own line (clearing the bar first on a terminal).
  void message(const std::string& text);
  void finish();

 private:
  FILE* out_;
  bool tty_;
  int64_t total_, every_;
  bool drawn_ = false, printed_ = false;
  std::chrono::steady_clock::time_point last_line_;
};

// Appends JSON objects, one per line, to a file (flushed per line).
class MetricsLog {
 public:
  // Opens `path`; when `keep_until_step` >= 0, lines with a step beyond it are dropped first
  // (a resumed run rewrites the steps after its checkpoint).
  MetricsLog(const std::string& path, int64_t keep_until_step);
  ~MetricsLog();
  void write(const json::Value& obj);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

struct Curve {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (step, loss)
};
// An SVG line chart of the curves (loss against step), axes and a legend.
std::string loss_curve_svg(const std::vector<Curve>& curves, const std::string& title);
// Reads the curves (train "loss", "eval_loss") back from a metrics log.
std::vector<Curve> curves_from_metrics(const std::string& path);

// The profile as JSON (harvests outstanding CUDA timings, like Profiler::entries()):
// {"entries": [{name, count, total_ms, mean_us, device_time}], "by_kernel": [...],
//  "syncs": {site: count}, "total_syncs": n}, entries and by_kernel largest total first.
json::Value profile_to_json(profile::Profiler& prof);

std::string format_duration(double seconds);
std::string format_bytes(int64_t bytes);

}  // namespace kiln::train
