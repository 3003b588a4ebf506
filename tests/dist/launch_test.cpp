// kiln launch with real processes: torchrun's variables and the store token reach every rank,
// output is prefixed, the first failure is reported (rank, exit code or signal, last lines),
// the others are stopped (SIGTERM, then SIGKILL after the grace), restarts happen up to
// --max-restarts, and bad arguments are errors that name the flag.
#include <sched.h>

#include <algorithm>
#include <chrono>

#include <gtest/gtest.h>

#include "tests/dist/dist_test_util.h"

using namespace kiln::dist::test;

TEST(Launch, VariablesAndPrefixes) {
  const auto r = run_command(kiln_cli() + " launch --nproc-per-node 3 --master-port 0 -- sh -c "
                             "'echo v $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR "
                             "$TORCHELASTIC_RESTART_COUNT ${#KILN_STORE_TOKEN}; echo e$RANK >&2'");
  EXPECT_EQ(r.status, 0) << r.output;
  for (int i = 0; i < 3; ++i) {
    const std::string s = std::to_string(i);
    EXPECT_TRUE(contains(r.output, "[rank " + s + "] v " + s + " " + s + " 3 3 127.0.0.1 0 64")) << r.output;
    EXPECT_TRUE(contains(r.output, "[rank " + s + "] e" + s)) << r.output;
  }
}

// As torchrun, ranks sharing a machine split its cores: OMP_NUM_THREADS, when unset, is the
// cores this process may run on divided by the ranks per node (at least 1); a set value stays,
// and one rank per node is left alone.
TEST(Launch, OmpThreadsSplitTheCoresUnlessSet) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const int cores = CPU_COUNT(&set);
  const std::string show = " -- sh -c 'echo t=$OMP_NUM_THREADS.'";
  for (int n : {2, 3}) {
    const auto r = run_command("env -u OMP_NUM_THREADS " + kiln_cli() + " launch --nproc-per-node " + std::to_string(n) +
                               " --master-port 0" + show);
    EXPECT_EQ(r.status, 0) << r.output;
    const std::string want = "t=" + std::to_string(std::max(1, cores / n)) + ".";
    for (int i = 0; i < n; ++i)
      EXPECT_TRUE(contains(r.output, "[rank " + std::to_string(i) + "] " + want)) << want << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "kiln launch: OMP_NUM_THREADS=")) << r.output;
  }
  auto r = run_command("env OMP_NUM_THREADS=3 " + kiln_cli() + " launch --nproc-per-node 2 --master-port 0" + show);
  EXPECT_TRUE(contains(r.output, "[rank 1] t=3.")) << r.output;
  EXPECT_FALSE(contains(r.output, "kiln launch: OMP_NUM_THREADS=")) << r.output;
  r = run_command("env -u OMP_NUM_THREADS " + kiln_cli() + " launch --nproc-per-node 1 --master-port 0" + show);
  EXPECT_TRUE(contains(r.output, "[rank 0] t=.")) << r.output;
}

TEST(Launch, FailureReportStopAndRestart) {
  // Rank 1 fails on the first attempt only; the others would sleep for a minute.
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_command(kiln_cli() + " launch --nproc-per-node 3 --master-port 0 --max-restarts 2 "
                             "--term-grace 1 -- sh -c 'if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then "
                             "if [ $RANK = 1 ]; then echo last words; exit 7; fi; sleep 60; fi; echo ok $RANK'");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 (pid")) << r.output;
  EXPECT_TRUE(contains(r.output, "failed first: exit code 7")) << r.output;
  EXPECT_TRUE(contains(r.output, "    last words")) << r.output;
  EXPECT_TRUE(contains(r.output, "restart 1 of 2")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 2] ok 2")) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

TEST(Launch, SigkillAfterGraceAndNoRestartLeft) {
  // Rank 0 ignores SIGTERM: the launcher must SIGKILL it after the grace period.
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_command(kiln_cli() + " launch --nproc-per-node 2 --master-port 0 --term-grace 0.5 -- "
                             "sh -c 'if [ $RANK = 1 ]; then sleep 0.2; kill -9 $$; fi; trap \"\" TERM; "
                             "sleep 30'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "failed first: signal 9 (SIGKILL)")) << r.output;
  EXPECT_TRUE(contains(r.output, "SIGKILL after 0.5 s")) << r.output;
  EXPECT_TRUE(contains(r.output, "the job failed")) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
}

TEST(Launch, BadArgumentsNameTheFlag) {
  auto r = run_command(kiln_cli() + " launch --nproc-per-node 0 -- true");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.output, "--nproc-per-node 0")) << r.output;
  r = run_command(kiln_cli() + " launch --nproc-per-node 2");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.output, "after '--'")) << r.output;
  r = run_command(kiln_cli() + " launch --policy maybe -- true");
  EXPECT_TRUE(contains(r.output, "--policy 'maybe'")) << r.output;
  r = run_command(kiln_cli() + " launch --master-port 0 -- /nonexistent/program");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "cannot run '/nonexistent/program'")) << r.output;
}

TEST(Launch, LogDirKeepsOutputAndEvents) {
  const std::string dir = ::testing::TempDir() + "kiln_launch_logs";
  run_command("rm -rf " + dir);
  const auto r = run_command(kiln_cli() + " launch --nproc-per-node 2 --master-port 0 --log-dir " + dir +
                             " -- sh -c 'echo out $RANK; echo $KILN_DIST_LOG_DIR; exit $RANK'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(run_command("cat " + dir + "/rank0.log").output, "out 0"));
  const auto events = run_command("cat " + dir + "/launcher.jsonl").output;
  EXPECT_TRUE(contains(events, "\"event\":\"rank_failed\"")) << events;
  EXPECT_TRUE(contains(events, "\"rank\":1")) << events;
}
