// The launcher behind `kiln launch`: starts the store (node 0), starts N ranks with torchrun's
// variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_RESTART_COUNT) plus KILN_STORE_TOKEN, prefixes each rank's output with
// "[rank N] ", watches the children every 0.1 s, reports the first failure (rank, pid, exit
// code or signal, its last lines), gives the others settle_s to exit on their own (their
// communicators report the failure from their side), then stops them (SIGTERM, SIGKILL after a grace
// period) and restarts up to max_restarts times, or under the shrink policy lets the survivors
// finish (a rank lost later is let go too; the job succeeds when some rank exits 0 and every rank
// that failed had ended before it). See docs/distributed.md ("Launching").
#pragma once
#include <string>
#include <vector>

namespace kiln::dist {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;   // 0: a free port (single node)
  int max_restarts = 0;
  std::string log_dir;       // per-rank output, launcher.jsonl, the ranks' event logs
  std::string policy;        // "" (the ranks' default, abort), "abort" or "shrink"
  double term_grace_s = 5.0; // SIGTERM, then SIGKILL after this
  double settle_s = 3.0;     // after a failure, how long the others may take to exit on their own
  int tail_lines = 20;       // lines of the failed rank's output in the report
  std::vector<std::string> program;  // argv of every rank
};

// Runs the job; returns the launcher's exit status (0 when every rank succeeded, or under
// shrink the ranks left at the end did; 1 after a failure with no restart left; 128 + signal when the
// launcher itself was interrupted).
int launch(const LaunchOptions& options);

}  // namespace kiln::dist
