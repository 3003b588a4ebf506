// The op-level profiler (see profile.h): per-key counts and times, device event pairs (the
// stream runtime's timing events) harvested in batches, the sorted table.
#include "kiln/core/profile.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "kiln/core/error.h"

namespace kiln::profile {

namespace {
// NOTE [profile switch] (profile.h): the one process-wide pointer.
std::atomic<Profiler*>& active_slot() {
  static std::atomic<Profiler*> slot{nullptr};
  return slot;
}
constexpr size_t kHarvestEvery = 4096;  // pending device event pairs before a (waiting) harvest
}  // namespace

Profiler* active() { return active_slot().load(std::memory_order_relaxed); }

Session::Session(Profiler& p) {
  Profiler* expected = nullptr;
  KILN_CHECK(active_slot().compare_exchange_strong(expected, &p), "profile: another profiler is already active");
}
Session::~Session() { active_slot().store(nullptr); }

bool env_requested() {
  // A value that is neither on nor off is an error naming it (KILN_PROFILE=banana profiled).
  const char* v = std::getenv("KILN_PROFILE");
  if (!v) return false;
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s.empty() || s == "0" || s == "false" || s == "no" || s == "off") return false;
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  fail("KILN_PROFILE='", v, "' is not 1 or 0 (also true/false, yes/no, on/off; unset: off)");
}

Profiler::~Profiler() = default;  // the events give their handles back themselves

Event Profiler::take_event(const Device& device) {
  auto it = free_events_.find(device.index);
  if (it == free_events_.end() || it->second.empty()) return Event(/*timing=*/true);
  Event e = std::move(it->second.back());
  it->second.pop_back();
  return e;
}

Profiler::Token Profiler::begin(const char* name, Device device) {
  Token t;
  t.device = device;
  std::lock_guard<std::mutex> g(mu_);
  t.key = labels_.empty() ? std::string(name) : labels_.back() + "/" + name;
  if (!device.is_cpu()) {
    // Harvest only between scopes: an open scope's stop event is not recorded yet.
    if (open_ == 0 && pending_.size() >= kHarvestEvery) harvest_locked();
    Pending p;
    p.key = t.key;
    p.start = take_event(device);
    p.stop = take_event(device);
    p.start.record(current_stream(device));
    ++open_;
    t.slot = static_cast<int64_t>(pending_.size());
    pending_.push_back(std::move(p));
    return t;
  }
  t.t0 = std::chrono::steady_clock::now();
  return t;
}

void Profiler::end(Token& t) {
  std::lock_guard<std::mutex> g(mu_);
  if (t.slot >= 0) {
    --open_;
    pending_[static_cast<size_t>(t.slot)].stop.record(current_stream(t.device));
    return;
  }
  add_locked(t.key, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t.t0).count(), false);
}

void Profiler::push_label(const std::string& label) {
  std::lock_guard<std::mutex> g(mu_);
  labels_.push_back(label);
}
void Profiler::pop_label() {
  std::lock_guard<std::mutex> g(mu_);
  if (!labels_.empty()) labels_.pop_back();
}
void Profiler::sync(const char* what) {
  std::lock_guard<std::mutex> g(mu_);
  ++syncs_[what];
}

void Profiler::add_locked(const std::string& key, double ms, bool device_time) {
  Entry& e = entries_[key];
  e.name = key;
  e.count += 1;
  e.total_ms += ms;
  e.device_time = e.device_time || device_time;
}

void Profiler::harvest_locked() {
  if (pending_.empty()) return;
  // Each stop event is waited for in turn (they may lie on several streams and devices).
  for (Pending& p : pending_) {
    p.stop.synchronize();
    add_locked(p.key, p.start.elapsed_ms(p.stop), true);
    std::vector<Event>& free = free_events_[p.stop.device().index];
    free.push_back(std::move(p.start));
    free.push_back(std::move(p.stop));
  }
  pending_.clear();
}

std::vector<Entry> Profiler::entries() {
  std::lock_guard<std::mutex> g(mu_);
  harvest_locked();
  std::vector<Entry> out;
  for (auto& [k, e] : entries_) out.push_back(e);
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) {
    return a.total_ms != b.total_ms ? a.total_ms > b.total_ms : a.name < b.name;
  });
  return out;
}

std::map<std::string, int64_t> Profiler::syncs() const {
  std::lock_guard<std::mutex> g(mu_);
  return syncs_;
}
int64_t Profiler::total_syncs() const {
  std::lock_guard<std::mutex> g(mu_);
  int64_t n = 0;
  for (auto& [k, c] : syncs_) n += c;
  return n;
}

void Profiler::reset() {
  std::lock_guard<std::mutex> g(mu_);
  harvest_locked();
  entries_.clear();
  syncs_.clear();
}

namespace {
// The kernel name of a key ("backward:matmul/gemm" -> "gemm").
std::string kernel_of(const std::string& key) {
  size_t slash = key.rfind('/');
  return slash == std::string::npos ? key : key.substr(slash + 1);
}
}  // namespace

std::vector<Entry> by_kernel(const std::vector<Entry>& es) {
  std::map<std::string, Entry> m;
  for (const Entry& e : es) {
    Entry& k = m[kernel_of(e.name)];
    k.name = kernel_of(e.name);
    k.count += e.count;
    k.total_ms += e.total_ms;
    k.device_time = k.device_time || e.device_time;
  }
  std::vector<Entry> out;
  for (auto& [k, e] : m) out.push_back(e);
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) { return a.total_ms > b.total_ms; });
  return out;
}

namespace {
void table_rows(std::string& s, const std::vector<Entry>& es, size_t rows, double total) {
  char buf[512];
  for (size_t i = 0; i < es.size() && i < rows; ++i) {
    const Entry& e = es[i];
    std::snprintf(buf, sizeof buf, "  %-52s %9lld %12.3f %10.1f %6.1f%%\n", e.name.c_str(),
                  static_cast<long long>(e.count), e.total_ms,
                  e.count ? 1000.0 * e.total_ms / static_cast<double>(e.count) : 0.0,
                  total > 0 ? 100.0 * e.total_ms / total : 0.0);
    s += buf;
  }
  if (es.size() > rows) s += "  ... " + std::to_string(es.size() - rows) + " more\n";
}
}  // namespace

std::string Profiler::table(size_t rows) {
  std::vector<Entry> es = entries();
  std::vector<Entry> ks = by_kernel(es);
  double total = 0;
  bool dev = false;
  for (const Entry& e : ks) total += e.total_ms, dev = dev || e.device_time;
  char buf[256];
  std::string s;
  std::snprintf(buf, sizeof buf, "profile: %.3f ms of %s time in kernel calls\n", total, dev ? "device" : "wall");
  s += buf;
  std::snprintf(buf, sizeof buf, "  %-52s %9s %12s %10s %7s\n", "call", "count", "total_ms", "mean_us", "share");
  s += buf;
  table_rows(s, es, rows, total);
  s += "per kernel:\n";
  table_rows(s, ks, rows, total);
  auto sy = syncs();
  int64_t n = 0;
  for (auto& [k, c] : sy) n += c;
  s += "host<->device synchronisations: " + std::to_string(n) + "\n";
  for (auto& [k, c] : sy) s += "  " + k + ": " + std::to_string(c) + "\n";
  return s;
}

}  // namespace kiln::profile
