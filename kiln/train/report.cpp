// Progress line, metrics log, SVG loss curve, profile JSON.
#include "kiln/train/report.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kiln/core/error.h"

namespace kiln::train {

namespace {
json::Value entries_json(const std::vector<profile::Entry>& es) {
  json::Value arr = json::Value::array();
  for (const profile::Entry& e : es) {
    json::Value o = json::Value::object();
    o["name"] = e.name;
    o["count"] = e.count;
    o["total_ms"] = e.total_ms;
    o["mean_us"] = e.count ? 1000.0 * e.total_ms / static_cast<double>(e.count) : 0.0;
    o["device_time"] = e.device_time;
    arr.push_back(std::move(o));
  }
  return arr;
}
}  // namespace

json::Value profile_to_json(profile::Profiler& prof) {
  std::vector<profile::Entry> es = prof.entries();
  json::Value v = json::Value::object();
  v["entries"] = entries_json(es);
  v["by_kernel"] = entries_json(profile::by_kernel(es));
  json::Value sy = json::Value::object();
  int64_t n = 0;
  for (auto& [k, c] : prof.syncs()) sy[k] = c, n += c;
  v["syncs"] = std::move(sy);
  v["total_syncs"] = n;
  return v;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  char buf[32];
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(t / 3600), (long long)(t % 3600 / 60));
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(t / 60), (long long)(t % 60));
  else std::snprintf(buf, sizeof buf, "%llds", (long long)t);
  return buf;
}

std::string format_bytes(int64_t b) {
  char buf[32];
  double x = static_cast<double>(b);
  if (x >= 1 << 30) std::snprintf(buf, sizeof buf, "%.2f GiB", x / (1 << 30));
  else if (x >= 1 << 20) std::snprintf(buf, sizeof buf, "%.1f MiB", x / (1 << 20));
  else std::snprintf(buf, sizeof buf, "%.0f KiB", x / 1024);
  return buf;
}

Progress::Progress(FILE* out, int64_t total, int64_t every)
    : out_(out), tty_(out && ::isatty(::fileno(out))), total_(total), every_(std::max<int64_t>(every, 1)) {}

void Progress::update(int64_t step, double loss, double tps, double eta, int64_t mem, double eval_loss) {
  if (!out_) return;
  const auto now = std::chrono::steady_clock::now();
  const bool keep = eval_loss >= 0 || step == total_;  // lines that stay: evaluations and the last step
  // A log file gets a line every `every` steps, at most one per 2 s (600 lines for the 43 s
  // demo, one per step), plus the lines that stay.
  if (!tty_ && !keep && (step % every_ != 0 || (printed_ && now - last_line_ < std::chrono::seconds(2)))) return;
  char bar[21];
  int fill = total_ > 0 ? static_cast<int>(20 * step / total_) : 0;
  for (int i = 0; i < 20; ++i) bar[i] = i < fill ? '#' : '.';
  bar[20] = 0;
  char ev[32] = "";
  if (eval_loss >= 0) std::snprintf(ev, sizeof ev, " eval %.4f", eval_loss);
  char line[256];
  std::snprintf(line, sizeof line, "[%s] step %lld/%lld  loss %.4f%s  %.0f tok/s  ETA %s  mem %s", bar,
                (long long)step, (long long)total_, loss, ev, tps, format_duration(eta).c_str(),
                format_bytes(mem).c_str());
  if (tty_) {
    // Within the terminal's width: a wrapped bar left a stale line per step on 80 columns
    // (\033[K clears one row). Evaluations stay in the scrollback.
    winsize ws{};
    const size_t width = ::ioctl(::fileno(out_), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 ? ws.ws_col - 1 : 79;
    std::fprintf(out_, "\r\033[K%.*s%s", static_cast<int>(std::min(width, std::strlen(line))), line,
                 eval_loss >= 0 ? "\n" : "");
    drawn_ = eval_loss < 0;
  } else {
    std::fprintf(out_, "%s\n", line);
  }
  printed_ = true;
  last_line_ = now;
  std::fflush(out_);
}

void Progress::message(const std::string& text) {
  if (!out_) return;
  if (drawn_) std::fprintf(out_, "\r\033[K");
  std::fprintf(out_, "%s\n", text.c_str());
  drawn_ = false;
  std::fflush(out_);
}

void Progress::finish() {
  if (out_ && drawn_) std::fprintf(out_, "\n");
  drawn_ = false;
}

MetricsLog::MetricsLog(const std::string& path, int64_t keep_until) : path_(path) {
  std::vector<std::string> kept;
  if (keep_until >= 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      try {
        json::Value v = json::parse(line);
        const json::Value* s = v.find("step");
        if (s && s->is_integer() && s->as_int() <= keep_until) kept.push_back(line);
      } catch (const Error&) {
        // a torn last line from a crash: dropped
      }
    }
  }
  f_ = std::fopen(path.c_str(), "w");
  KILN_CHECK(f_ != nullptr, "metrics: cannot open '", path, "' for writing");
  for (const auto& l : kept) std::fprintf(f_, "%s\n", l.c_str());
  std::fflush(f_);
}

MetricsLog::~MetricsLog() {
  if (f_) std::fclose(f_);
}

void MetricsLog::write(const json::Value& obj) {
  if (!ok()) return;
  errno = 0;
  if (std::fprintf(f_, "%s\n", obj.dump().c_str()) < 0 || std::fflush(f_) != 0) {
    const json::Value* step = obj.find("step");
    error_ = path_ + " could not be written" +
             (step && step->is_integer() ? " at step " + std::to_string(step->as_int()) : std::string()) + " (" +
             (errno ? std::strerror(errno) : "write error") + ")";
  }
}

std::string MetricsLog::take_warning() {
  if (ok() || warned_) return "";
  warned_ = true;
  return "warning: " + error_ + ": no more metrics lines are written; the run stops at its next checkpoint";
}

void DivergenceWatch::observe(double loss) {
  if (!std::isfinite(loss)) return;  // counted by the trainer's non-finite check
  if (first_ < 0) first_ = loss;
  last_ = loss;
  in_a_row_ = loss > kGrowth * std::max(first_, 1.0) ? in_a_row_ + 1 : 0;
}

std::string DivergenceWatch::message(const std::string& what, int64_t step, double lr) const {
  std::ostringstream m;
  m << "train: " << what << " (loss " << last_ << " at step " << step << ", " << in_a_row_
    << " step(s) in a row above " << kGrowth << " x the first loss, " << first_
    << "): training diverged; lower --lr (it is " << lr << ") or check the data";
  return m.str();
}

std::vector<Curve> curves_from_metrics(const std::string& path) {
  Curve train{"train loss", {}}, eval{"eval loss", {}};
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    try {
      json::Value v = json::parse(line);
      const json::Value* s = v.find("step");
      if (!s || !s->is_integer()) continue;
      double step = static_cast<double>(s->as_int());
      if (const json::Value* l = v.find("loss"); l && l->is_number()) train.points.emplace_back(step, l->as_double());
      if (const json::Value* l = v.find("eval_loss"); l && l->is_number()) eval.points.emplace_back(step, l->as_double());
    } catch (const Error&) {
    }
  }
  std::vector<Curve> out{train};
  if (!eval.points.empty()) out.push_back(eval);
  return out;
}

std::string loss_curve_svg(const std::vector<Curve>& curves, const std::string& title) {
  const double W = 720, H = 420, L = 64, R = 20, T = 36, B = 48;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const auto& c : curves)
    for (auto [x, y] : c.points) {
      if (!std::isfinite(y)) continue;
      x0 = std::min(x0, x); x1 = std::max(x1, x);
      y0 = std::min(y0, y); y1 = std::max(y1, y);
    }
  if (x0 > x1) { x0 = 0; x1 = 1; y0 = 0; y1 = 1; }
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) { y1 += 0.5; y0 -= 0.5; }
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad; y1 += pad;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return T + (y1 - y) / (y1 - y0) * (H - T - B); };
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << " " << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << title << "</text>\n";
  s << "<g stroke=\"#ccc\">\n";
  for (int i = 0; i <= 5; ++i) {
    double y = y0 + (y1 - y0) * i / 5, x = x0 + (x1 - x0) * i / 5;
    s << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << py(y) << "\" y2=\"" << py(y) << "\"/>\n";
    s << "<line y1=\"" << T << "\" y2=\"" << H - B << "\" x1=\"" << px(x) << "\" x2=\"" << px(x) << "\"/>\n";
  }
  s << "</g>\n<g fill=\"#333\">\n";
  for (int i = 0; i <= 5; ++i) {
    double y = y0 + (y1 - y0) * i / 5, x = x0 + (x1 - x0) * i / 5;
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", y);
    s << "<text x=\"" << L - 6 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\">" << buf << "</text>\n";
    std::snprintf(buf, sizeof buf, "%.0f", x);
    s << "<text x=\"" << px(x) << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">" << buf << "</text>\n";
  }
  s << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\">step</text>\n";
  s << "<text transform=\"translate(16 " << (T + H - B) / 2 << ") rotate(-90)\" text-anchor=\"middle\">loss</text>\n";
  s << "</g>\n";
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd"};
  for (size_t c = 0; c < curves.size(); ++c) {
    const char* col = colors[c % 4];
    s << "<polyline fill=\"none\" stroke=\"" << col << "\" stroke-width=\"1.5\" points=\"";
    for (auto [x, y] : curves[c].points)
      if (std::isfinite(y)) s << px(x) << "," << py(y) << " ";
    s << "\"/>\n";
    s << "<rect x=\"" << W - R - 130 << "\" y=\"" << T + 8 + 18 * c << "\" width=\"12\" height=\"3\" fill=\"" << col
      << "\"/><text x=\"" << W - R - 112 << "\" y=\"" << T + 13 + 18 * c << "\">" << curves[c].name << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace kiln::train
