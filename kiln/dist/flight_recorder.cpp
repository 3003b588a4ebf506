// The flight recorder (flight_recorder.h).
#include "kiln/dist/flight_recorder.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "kiln/dist/dist_log.h"

namespace kiln::dist {
namespace {
std::atomic<bool> g_dump_requested{false};  // set by the SIGUSR1 handler
extern "C" void on_sigusr1(int) { g_dump_requested.store(true); }

size_t buffer_size_from_env() {
  const char* v = std::getenv("KILN_FR_BUFFER_SIZE");
  if (!v || !*v) return 2000;
  const long n = std::atol(v);
  return n >= 1 && n <= 10000000 ? static_cast<size_t>(n) : 2000;
}
}  // namespace

FlightRecorder& FlightRecorder::instance() {
  static FlightRecorder fr;
  return fr;
}

FlightRecorder::FlightRecorder() : capacity_(buffer_size_from_env()) {}

int64_t FlightRecorder::record(FrEntry e) {
  std::lock_guard<std::mutex> lock(mu_);
  e.id = next_id_++;
  e.enqueued = unix_seconds();
  if (ring_.size() < capacity_) ring_.push_back(std::move(e));
  else ring_[static_cast<size_t>(e.id) % capacity_] = std::move(e);
  return next_id_ - 1;
}

FrEntry* FlightRecorder::find(int64_t id) {
  if (id < 0 || id >= next_id_ || next_id_ - id > static_cast<int64_t>(capacity_)) return nullptr;
  FrEntry& e = ring_[static_cast<size_t>(id) % capacity_];
  return e.id == id ? &e : nullptr;
}

void FlightRecorder::started(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (FrEntry* e = find(id)) {
    e->started = unix_seconds();
    e->state = "started";
  }
}

void FlightRecorder::finished(int64_t id, const std::string& state) {
  std::lock_guard<std::mutex> lock(mu_);
  if (FrEntry* e = find(id)) {
    e->completed = unix_seconds();
    e->state = state;
  }
}

void FlightRecorder::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  ring_.clear();
  next_id_ = 0;
}

json::Value FlightRecorder::to_json(const std::string& reason) const {
  std::lock_guard<std::mutex> lock(mu_);
  json::Value out = json::Value::object();
  const char* rank = std::getenv("RANK");
  out["version"] = 1;
  out["rank"] = static_cast<int64_t>(rank ? std::atoll(rank) : 0);
  out["pid"] = static_cast<int64_t>(getpid());
  out["reason"] = reason;
  out["time"] = unix_seconds();
  json::Value entries = json::Value::array();
  const int64_t first = std::max<int64_t>(0, next_id_ - static_cast<int64_t>(capacity_));
  for (int64_t id = first; id < next_id_; ++id) {
    const FrEntry& e = ring_[static_cast<size_t>(id) % capacity_];
    json::Value j = json::Value::object();
    j["record_id"] = e.id;
    j["comm"] = e.comm;
    j["comm_rank"] = e.comm_rank;
    j["comm_size"] = e.comm_size;
    j["seq"] = e.seq;
    j["op"] = e.op;
    j["in_numel"] = e.in_numel;
    j["out_numel"] = e.out_numel;
    j["dtype"] = e.dtype;
    if (e.peer >= 0) j["peer"] = e.peer;
    j["timeout_ms"] = e.timeout_ms;
    j["time_enqueued"] = e.enqueued;
    if (e.started > 0) j["time_started"] = e.started;
    if (e.completed > 0) j["time_completed"] = e.completed;
    j["state"] = e.state;
    entries.push_back(std::move(j));
  }
  out["entries"] = std::move(entries);
  return out;
}

std::string FlightRecorder::dump(const std::string& reason) const {
  const char* dir = std::getenv("KILN_FR_DUMP_DIR");
  if (!dir || !*dir) dir = std::getenv("KILN_DIST_LOG_DIR");
  if (!dir || !*dir) return "";
  const char* rank = std::getenv("RANK");
  const std::string path = std::string(dir) + "/kiln_fr_rank" + (rank && *rank ? rank : "0") + ".json";
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) return "";
    f << to_json(reason).dump(1) << "\n";
    if (!f) return "";
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return "";
  return path;
}

void FlightRecorder::install_sigusr1() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_handler = on_sigusr1;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, nullptr);
  });
}

bool FlightRecorder::take_dump_request() { return g_dump_requested.exchange(false); }

}  // namespace kiln::dist
