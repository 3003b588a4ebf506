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

// Appends JSON objects, one per line, to a file (flushed per line). A write that fails (a full
// disk) is not silent: ok() turns false, the warning says why (errno's text), and no line is
// written after it (a cut line and then lines missing read as a complete log).
class MetricsLog {
 public:
  // Opens `path`; when `keep_until_step` >= 0, lines with a step beyond it are dropped first
  // (a resumed run rewrites the steps after its checkpoint).
  MetricsLog(const std::string& path, int64_t keep_until_step);
  ~MetricsLog();
  void write(const json::Value& obj);
  const std::string& path() const { return path_; }
  bool ok() const { return error_.empty(); }
  // Why the log stopped ("" while ok), e.g. "metrics.jsonl could not be written at step 12 (No
  // space left on device)".
  const std::string& error() const { return error_; }
  // The warning of the first failed write, once ("" otherwise).
  std::string take_warning();
  // Whether a run whose log failed stops at `step`: at its next checkpoint boundary (every
  // `ckpt_every` steps; at once when there are no interval checkpoints).
  bool stop_at(int64_t step, int64_t ckpt_every) const { return !ok() && (ckpt_every <= 0 || step % ckpt_every == 0); }

 private:
  std::string path_;
  FILE* f_ = nullptr;
  std::string error_;
  bool warned_ = false;
};

// Divergence by growth (non-finite losses are the trainer's own check): a finite loss more than
// kGrowth times the run's first loss (taken as at least 1) is a diverged step. A run stops
// (kiln::Error) after kMaxSteps of them in a row, and one whose last step diverged ends with an
// error after its checkpoint: `--lr 100` (loss 5.5 -> 1.1 M) reported "done", exit status 0.
class DivergenceWatch {
 public:
  static constexpr double kGrowth = 100;
  static constexpr int kMaxSteps = 10;
  void observe(double loss);
  bool in_a_row_limit() const { return in_a_row_ >= kMaxSteps; }
  bool last_diverged() const { return in_a_row_ > 0; }
  // "train: <what> (loss L at step S, N step(s) in a row above 100 x the first loss F):
  // training diverged; lower --lr (it is LR) or check the data"
  std::string message(const std::string& what, int64_t step, double lr) const;

 private:
  double first_ = -1, last_ = 0;
  int in_a_row_ = 0;
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
