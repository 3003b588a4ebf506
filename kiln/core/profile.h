// The op-level profiler: where the time of a run goes, per kernel entry point.
//
//   profile::Profiler prof;
//   { profile::Session on(prof); ...run... }       // while a Session lives, prof is active
//   std::cout << prof.table();
//
// The JSON form (profile.json) is written by the trainer: train::profile_to_json
// (kiln/train/report.h); core does not depend on io.
//
// While a profiler is active, every kernel dispatch (KILN_DEVICE_CALL, the flex-attention
// kernels, host<->device copies) is timed: on a GPU by timing events of the stream runtime
// (kiln/core/stream.h) recorded on the thread's current stream around the call (device time;
// harvested in batches and at report time), on CPU by wall time.
// Calls are keyed "kernel" or, inside an autograd backward, "backward:<node>/kernel"; the
// engine pushes that label (profile::Label). Host<->device synchronisations (D2H copies,
// stream/device synchronize, the synchronising cudaFree) are counted per site
// (profile::count_sync). When no profiler is active each hook costs one relaxed atomic load.
//
// NOTE [profile switch]: the active profiler is the one process-wide switch (a pointer read by
// every kernel dispatch); there is no other global state. One Session at a time.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kiln/core/device.h"
#include "kiln/core/stream.h"

namespace kiln::profile {

struct Entry {
  std::string name;
  int64_t count = 0;
  double total_ms = 0;  // device time on CUDA, wall time on CPU
  bool device_time = false;
};

class Profiler {
 public:
  Profiler() = default;
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Hooks (called through Scope / Label / count_sync).
  struct Token {
    int64_t slot = -1;  // pending device event pair, or -1
    std::chrono::steady_clock::time_point t0;
    std::string key;
    Device device;
  };
  Token begin(const char* name, Device device);
  void end(Token& t);
  void push_label(const std::string& label);
  void pop_label();
  void sync(const char* what);

  // Harvests outstanding device timings (waits for them) and returns the entries, largest total first.
  std::vector<Entry> entries();
  // Host<->device synchronisations per site, and their total.
  std::map<std::string, int64_t> syncs() const;
  int64_t total_syncs() const;
  // Forgets everything recorded so far (e.g. after a warm-up step).
  void reset();
  // A sorted text table (top `rows` entries, then per-kernel totals, then the syncs).
  std::string table(size_t rows = 40);

 private:
  struct Pending {
    std::string key;
    Event start, stop;
  };
  Event take_event(const Device& device);  // a recycled timing event of `device`, or a new one
  void harvest_locked();
  void add_locked(const std::string& key, double ms, bool device_time);
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, int64_t> syncs_;
  std::vector<std::string> labels_;
  std::vector<Pending> pending_;
  std::map<int, std::vector<Event>> free_events_;  // harvested timing events per device index
  int64_t open_ = 0;  // device scopes begun and not yet ended
};

// Per-kernel totals of `es` (keys "backward:<node>/<kernel>" folded into "<kernel>"), largest
// total first.
std::vector<Entry> by_kernel(const std::vector<Entry>& es);

// The active profiler or null (the process-wide switch, see the note above).
Profiler* active();

// Makes `p` the active profiler for its lifetime (one at a time).
class Session {
 public:
  explicit Session(Profiler& p);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

// Times one kernel call when a profiler is active (no-op otherwise).
class Scope {
 public:
  Scope(const char* name, Device device) : p_(active()) {
    if (p_) t_ = p_->begin(name, device);
  }
  ~Scope() {
    if (p_) p_->end(t_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Profiler* p_;
  Profiler::Token t_;
};

// Prefixes the keys of the kernels called in its lifetime (the engine: "backward:<node>").
class Label {
 public:
  explicit Label(const char* prefix, const std::string& name) : p_(active()) {
    if (p_) p_->push_label(std::string(prefix) + name);
  }
  ~Label() {
    if (p_) p_->pop_label();
  }
  Label(const Label&) = delete;
  Label& operator=(const Label&) = delete;

 private:
  Profiler* p_;
};

// Counts one host<->device synchronisation at `what` when a profiler is active.
inline void count_sync(const char* what) {
  if (Profiler* p = active()) p->sync(what);
}

// True when the environment asks for profiling: KILN_PROFILE 1, true, yes or on (any case);
// false when it is unset, empty, 0, false, no or off; kiln::Error naming any other value.
bool env_requested();

}  // namespace kiln::profile
