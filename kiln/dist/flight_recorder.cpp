// The flight recorder (flight_recorder.h).
#include "kiln/dist/flight_recorder.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "kiln/core/env.h"
#include "kiln/dist/dist_log.h"

namespace kiln::dist {
namespace {
std::atomic<bool> g_dump_requested{false};  // set by the SIGUSR1 handler
extern "C" void on_sigusr1(int) { g_dump_requested.store(true); }

size_t buffer_size_from_env() { return static_cast<size_t>(env_integer("KILN_FR_BUFFER_SIZE", 1, 10000000, 2000)); }

// RANK / WORLD_SIZE (SLURM_PROCID / SLURM_NTASKS under SLURM); -1 when unset.
int env_rank_var(const char* name, const char* slurm) {
  constexpr int64_t kMax = int64_t{1} << 24;
  return static_cast<int>(env_integer(name, 0, kMax, env_integer(slurm, 0, kMax, -1)));
}
}  // namespace

std::vector<int> root_members(int rank, int size) {
  const int env_rank = env_rank_var("RANK", "SLURM_PROCID");
  const int env_size = env_rank_var("WORLD_SIZE", "SLURM_NTASKS");
  std::vector<int> m(static_cast<size_t>(std::max(size, 0)), -1);
  const bool whole_job = (env_rank < 0 || env_rank == rank) && (env_size < 0 || env_size == size);
  for (int r = 0; r < size; ++r)
    if (whole_job) m[static_cast<size_t>(r)] = r;
  if (!whole_job && rank >= 0 && rank < size && env_rank >= 0) m[static_cast<size_t>(rank)] = env_rank;
  return m;
}

std::vector<int> split_members(const std::vector<int>& parent, const std::vector<int>& ranks) {
  std::vector<int> m;
  m.reserve(ranks.size());
  for (int r : ranks) m.push_back(r >= 0 && r < static_cast<int>(parent.size()) ? parent[static_cast<size_t>(r)] : -1);
  return m;
}

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

void FlightRecorder::joined(FrComm c) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& k : comms_)
    if (k.name == c.name && k.generation == c.generation && k.rank == c.rank) {
      k = std::move(c);
      return;
    }
  if (comms_.size() >= kMaxComms) comms_.erase(comms_.begin());
  comms_.push_back(std::move(c));
}

void FlightRecorder::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  ring_.clear();
  comms_.clear();
  next_id_ = 0;
}

json::Value FlightRecorder::to_json(const std::string& reason) const {
  std::lock_guard<std::mutex> lock(mu_);
  json::Value out = json::Value::object();
  const int rank = env_rank_var("RANK", "SLURM_PROCID");
  int world = env_rank_var("WORLD_SIZE", "SLURM_NTASKS");
  if (world < 1) {  // not launched: the largest rank any communicator names, plus one
    world = 1;
    for (const auto& c : comms_)
      for (int m : c.members) world = std::max(world, m + 1);
  }
  out["version"] = 2;
  out["rank"] = static_cast<int64_t>(rank >= 0 ? rank : 0);
  out["world_size"] = static_cast<int64_t>(world);
  out["pid"] = static_cast<int64_t>(getpid());
  out["reason"] = reason;
  out["time"] = unix_seconds();
  json::Value comms = json::Value::array();
  for (const auto& c : comms_) {
    json::Value j = json::Value::object();
    j["comm"] = c.name;
    j["generation"] = c.generation;
    j["rank"] = c.rank;
    j["size"] = c.size;
    json::Value m = json::Value::array();
    for (int r : c.members) m.push_back(static_cast<int64_t>(r));
    j["ranks"] = std::move(m);
    comms.push_back(std::move(j));
  }
  out["comms"] = std::move(comms);
  json::Value entries = json::Value::array();
  const int64_t first = std::max<int64_t>(0, next_id_ - static_cast<int64_t>(capacity_));
  for (int64_t id = first; id < next_id_; ++id) {
    const FrEntry& e = ring_[static_cast<size_t>(id) % capacity_];
    json::Value j = json::Value::object();
    j["record_id"] = e.id;
    j["comm"] = e.comm;
    if (e.generation) j["generation"] = e.generation;
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
