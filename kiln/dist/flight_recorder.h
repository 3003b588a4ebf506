// The flight recorder: a ring buffer per process (KILN_FR_BUFFER_SIZE entries, 2,000 by default)
// of every communicator operation: record id, communicator name and generation, rank and size in
// it, sequence number, op, element counts, dtype, peer, timeout, times enqueued / started /
// completed and state; and a table of the communicators this process joined (name, generation,
// its rank, size, and the job's ranks of the members), so that a dump says which ranks should
// have left one too. Dumped as one JSON file per rank (kiln_fr_rank<R>.json under
// KILN_FR_DUMP_DIR, else KILN_DIST_LOG_DIR; "world_size" from WORLD_SIZE) on a timeout, an abort,
// SIGUSR1 or on request; `kiln comms analyze` reads the dumps of all ranks (fr_analyze.h).
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "kiln/io/json.h"

namespace kiln::dist {

struct FrEntry {
  int64_t id = 0;
  std::string comm;
  int generation = 0;  // of the communicator (shrinks renumber: seq restarts at 1)
  int comm_rank = 0, comm_size = 0;
  int64_t seq = 0;
  std::string op;
  int64_t in_numel = 0, out_numel = 0;
  std::string dtype;
  int peer = -1;  // send / recv / broadcast root
  int64_t timeout_ms = 0;
  double enqueued = 0, started = 0, completed = 0;  // Unix seconds; 0: not yet
  std::string state = "scheduled";                  // scheduled, started, completed, timed_out, error
};

// A communicator this process is a member of.
struct FrComm {
  std::string name;
  int generation = 0;
  int rank = 0, size = 0;    // this process's rank in it, and its size
  std::vector<int> members;  // the job's rank (RANK) of each of its ranks; -1: not known here
};

// The members of a communicator made over the whole job: the identity when this process's RANK
// and WORLD_SIZE are (rank, size) or unset, else only this process's own place.
std::vector<int> root_members(int rank, int size);
// The members of a communicator split from one whose members are `parent`: ranks are the
// parent's ranks in the new order.
std::vector<int> split_members(const std::vector<int>& parent, const std::vector<int>& ranks);

// One per process (the registry kind: every communicator of the process records into it, and
// a dump must show them all in order).
class FlightRecorder {
 public:
  static FlightRecorder& instance();
  int64_t record(FrEntry e);  // returns the entry's id
  void started(int64_t id);
  void finished(int64_t id, const std::string& state);
  // Records (or replaces: same name, generation and rank) a communicator this process joined.
  void joined(FrComm c);
  json::Value to_json(const std::string& reason) const;
  // Writes the dump file; returns its path, or "" when no folder is set (or writing failed).
  std::string dump(const std::string& reason) const;
  void clear();
  size_t capacity() const { return capacity_; }
  // SIGUSR1 asks for a dump; the watchdogs write it (a signal handler cannot).
  static void install_sigusr1();
  static bool take_dump_request();

 private:
  FlightRecorder();
  FrEntry* find(int64_t id);
  mutable std::mutex mu_;
  std::vector<FrEntry> ring_;
  size_t capacity_;
  int64_t next_id_ = 0;
  std::vector<FrComm> comms_;  // at most kMaxComms, the oldest dropped first
  static constexpr size_t kMaxComms = 4096;
};

}  // namespace kiln::dist
