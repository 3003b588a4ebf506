// `kiln launch`: runs a program as N ranks with torchrun's conventions (kiln/dist/launcher.h).
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/dist/launcher.h"

namespace kiln::cli {

int run_launch(const Args& args) {
  Args own;
  dist::LaunchOptions o;
  size_t i = 0;
  for (; i < args.size() && args[i] != "--"; ++i) own.push_back(args[i]);
  if (i < args.size()) o.program.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
  int64_t nproc = 1, nnodes = 1, node_rank = 0, port = 29500, restarts = 0;
  double grace = 5.0;
  ArgParser p("launch",
              "Run PROGRAM as N ranks on this node, as torchrun does: each rank gets RANK, LOCAL_RANK,\n"
              "WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RESTART_COUNT, plus\n"
              "KILN_STORE_TOKEN, the secret of the job's store (which node 0's launcher serves on\n"
              "MASTER_ADDR:MASTER_PORT, authenticated, 127.0.0.1 unless another address is given). Each\n"
              "line a rank prints is prefixed '[rank N] '. When a rank fails, the launcher names it (pid,\n"
              "exit code or signal, its last lines of output), stops the others (SIGTERM, then SIGKILL\n"
              "after --term-grace) and restarts all of them up to --max-restarts times; under --policy\n"
              "shrink it lets the survivors go on.");
  p.option("--nproc-per-node", &nproc, "N", "ranks to start on this node")
      .option("--nnodes", &nnodes, "M", "nodes in the job")
      .option("--node-rank", &node_rank, "R", "this node's index in [0, M)")
      .option("--master-addr", &o.master_addr, "A", "address of node 0's store (binds there)")
      .option("--master-port", &port, "P", "port of the store; 0 picks a free one (single node)")
      .option("--max-restarts", &restarts, "K", "restarts of the whole job after a failure")
      .option("--log-dir", &o.log_dir, "DIR",
              "per-rank output (rank<N>.log), the ranks' JSON-lines events (rank<N>.jsonl), flight-recorder "
              "dumps and launcher.jsonl")
      .without_default()
      .option("--policy", &o.policy, "abort|shrink",
              "failure policy the ranks get (KILN_DIST_POLICY); shrink also keeps the survivors running")
      .without_default()
      .option("--term-grace", &grace, "SECONDS", "between SIGTERM and SIGKILL when stopping ranks")
      .epilog("\nusage: kiln launch [options] -- PROGRAM ARGS...\n"
              "example: kiln launch --nproc-per-node 4 --master-port 0 -- kiln bench comms --op all_reduce\n");
  if (!p.parse(own)) return 0;
  KILN_CHECK(!o.program.empty(), "no program: put it after '--' (kiln launch [options] -- PROGRAM ARGS...)");
  KILN_CHECK(grace >= 0 && grace <= 3600, "--term-grace ", grace, " out of range [0, 3600]");
  o.nproc_per_node = static_cast<int>(nproc);
  o.nnodes = static_cast<int>(nnodes);
  o.node_rank = static_cast<int>(node_rank);
  o.master_port = static_cast<int>(port);
  o.max_restarts = static_cast<int>(restarts);
  o.term_grace_s = grace;
  return dist::launch(o);
}

}  // namespace kiln::cli
