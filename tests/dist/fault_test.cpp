// Faults with real processes: a rank that sleeps past a short timeout (the others report a
// timeout naming the op and the rank that never joined, within timeout + 2 s, with a flight-
// recorder dump and a JSON-lines event; the launcher stops the sleeper, which leaves no dump, and
// kiln comms analyze on the folder names it); a dead TCP peer (a rank killed while the others
// wait, with a long timeout) detected by every survivor within 2 s; a rank killed with SIGKILL
// mid-job under abort (the survivors exit non-zero naming the op, within timeout + 2 s) and under
// shrink (the survivors go on as a smaller communicator whose collectives are correct). The
// sleeper, the dead peer and the killed rank each run twice: in all_reduce's TCP path (the direct
// exchange of the tiny tensors) and in the shared-memory segment of ranks on one host
// (the default), where a gone peer is seen by its pid, not by a closed connection.
#include <chrono>
#include <cstdlib>
#include <regex>

#include <gtest/gtest.h>

#include "tests/dist/dist_test_util.h"

using namespace kiln::dist::test;

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

// The parameter: the environment that picks all_reduce's path.
class FaultsOnAPath : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "KILN_GLOO_SHM=1" && !have_shm())
      GTEST_SKIP() << "no POSIX shared memory here (/dev/shm): the segment's path cannot run";
  }
  // Rank 0's init event (in the run's log folder) says the path the parameter asked for ran.
  void expect_path(const std::string& dir) {
    const auto events = run_command("cat " + dir + "/rank0.jsonl").output;
    const std::string want = GetParam() == "KILN_GLOO_SHM=1" ? "\"shared_memory\":\"on\""
                                                             : "\"shared_memory\":\"off: KILN_GLOO_SHM=0\"";
    EXPECT_TRUE(contains(events, want)) << events;
  }
};
INSTANTIATE_TEST_SUITE_P(Paths, FaultsOnAPath, ::testing::Values("KILN_GLOO_SHM=0", "KILN_GLOO_SHM=1"),
                         [](const auto& info) { return info.index == 0 ? "tcp" : "shared_memory"; });

TEST_P(FaultsOnAPath, SleeperTimesOutNamingOpAndRankWithDump) {
  KILN_SKIP_WITHOUT_GLOO();
  const std::string dir = fresh_test_dir("fault_sleeper");
  const auto t0 = Clock::now();
  const auto r = run_ranks(3, "sleeper", "KILN_TEST_TIMEOUT_MS=1500 " + GetParam(), "--log-dir " + dir);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "all_reduce #3 of 'world' (3 elements of f32) timed out after 1500 ms")) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 has not joined it (rank 1 last started #2)")) << r.output;
  if (GetParam() == "KILN_GLOO_SHM=1") {
    EXPECT_TRUE(contains(r.output, "shared-memory all_reduce timed out after 1500 ms (inputs) waiting for rank(s) 1"))
        << r.output;
  }
  EXPECT_TRUE(contains(r.output, "exit code 70")) << r.output;
  EXPECT_TRUE(contains(r.output, "flight recorder: " + dir + "/kiln_fr_rank0.json")) << r.output;
  // Detected within the timeout + 2 s of the sleeper going quiet (start-up included, generously).
  EXPECT_LT(secs, 1.5 + 2 + 4) << r.output;
  const auto dump = run_command("cat " + dir + "/kiln_fr_rank0.json").output;
  EXPECT_TRUE(contains(dump, "\"state\": \"timed_out\"")) << dump;
  const auto events = run_command("cat " + dir + "/rank0.jsonl").output;
  EXPECT_TRUE(contains(events, "\"event\":\"timeout\"")) << events;
  EXPECT_TRUE(contains(events, "\"event\":\"init\"")) << events;
  expect_path(dir);
}

TEST(Faults, AnalyzerNamesTheSleeperThatLeftNoDump) {
  KILN_SKIP_WITHOUT_GLOO();
  // Ranks 0 and 2 time out in all_reduce #3 and dump; the launcher then stops rank 1, still
  // asleep, which leaves no dump. The analyzer learns from the others' dumps that the job has 3
  // ranks and names rank 1 and the op they waited in.
  const std::string dir = fresh_test_dir("fault_analyze");
  const auto r = run_ranks(3, "sleeper", "KILN_TEST_TIMEOUT_MS=1000", "--log-dir " + dir);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_FALSE(contains(run_command("ls " + dir).output, "kiln_fr_rank1.json")) << run_command("ls " + dir).output;
  const auto a = run_command(kiln_cli() + " comms analyze " + dir, 20);
  EXPECT_EQ(a.status, 1) << a.output;
  EXPECT_TRUE(contains(a.output, "comm 'world' (3 ranks, ops #1 to #3): rank 1 never joined all_reduce #3 of 'world' "
                                 "(it left no dump; "))
      << a.output;
  EXPECT_TRUE(contains(a.output, "last completed: rank 0 #2, rank 1: no dump, rank 2 #2")) << a.output;
  EXPECT_TRUE(contains(a.output, "rank 1 left no dump (never joined / died?)")) << a.output;
  EXPECT_FALSE(contains(a.output, "every rank joined")) << a.output;
  const auto j = run_command(kiln_cli() + " comms analyze " + dir + " --json", 20);
  EXPECT_TRUE(contains(j.output, "\"world_size\": 3")) << j.output;
  EXPECT_TRUE(std::regex_search(j.output, std::regex("\"ranks_without_dump\": \\[\\s*1\\s*\\]"))) << j.output;
}

TEST_P(FaultsOnAPath, DeadPeerDetectedWithinTwoSeconds) {
  KILN_SKIP_WITHOUT_GLOO();
  // A 20 s timeout: only the closed connections (or the gone pid) can end the survivors'
  // all_reduce in time.
  const auto t0 = Clock::now();
  const auto r = run_ranks(3, "dead_peer", "KILN_TEST_TIMEOUT_MS=20000 " + GetParam());
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(contains(r.output, "failed first: signal 9 (SIGKILL)")) << r.output;
  std::smatch k;
  ASSERT_TRUE(std::regex_search(r.output, k, std::regex("\\[rank 1\\] killed at ([0-9.]+)"))) << r.output;
  const double killed = std::atof(k[1].str().c_str());
  for (int rank : {0, 2}) {
    std::smatch m;
    const std::regex re("\\[rank " + std::to_string(rank) +
                        "\\] dead peer detected at ([0-9.]+), [0-9.]+ s into op ([23]): (.*)");
    ASSERT_TRUE(std::regex_search(r.output, m, re)) << r.output;
    EXPECT_LT(std::atof(m[1].str().c_str()) - killed, 2.0) << m[0];
    EXPECT_TRUE(contains(m[3].str(), "all_reduce #" + m[2].str() + " of 'world' (3 elements of f32) failed")) << m[0];
    EXPECT_FALSE(contains(m[3].str(), "timed out")) << m[0];
  }
  EXPECT_LT(secs, 15) << r.output;  // far inside the 20 s timeout, start-up included
  if (GetParam() == "KILN_GLOO_SHM=1") {  // the segment saw the pid gone
    EXPECT_TRUE(contains(r.output, "gloo: shared-memory all_reduce: rank 1 (pid ")) << r.output;
  }
}

TEST_P(FaultsOnAPath, KilledRankUnderAbortExitsNamingTheOp) {
  KILN_SKIP_WITHOUT_GLOO();
  const std::string dir = fresh_test_dir("fault_abort");
  const auto t0 = Clock::now();
  const auto r = run_ranks(3, "killed", "KILN_TEST_TIMEOUT_MS=5000 " + GetParam(), "--log-dir " + dir);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(r.status, 1) << r.output;
  // Within the timeout + 2 s of the kill (start-up and the launcher's stop included, generously).
  EXPECT_LT(secs, 5 + 2 + 4) << r.output;
  // The launcher reports whichever it reaps first: the killed rank or a survivor exiting 70.
  EXPECT_TRUE(contains(r.output, "signal 9 (SIGKILL)") || contains(r.output, "exit code 70")) << r.output;
  // #3 normally; #2 when rank 1 died while a peer still finished its part of #2.
  EXPECT_TRUE(std::regex_search(r.output, std::regex("all_reduce #[23] of 'world' \\(3 elements of f32\\) failed: "
                                                     "(rank 1 has not joined it|every rank had started it)")))
      << r.output;
  EXPECT_TRUE(contains(r.output, "policy abort: exiting with status 70")) << r.output;
  EXPECT_TRUE(contains(r.output, "(flight recorder: " + dir + "/kiln_fr_rank")) << r.output;
  EXPECT_TRUE(contains(r.output, "kiln launch: the job failed")) << r.output;
  expect_path(dir);
}

TEST_P(FaultsOnAPath, KilledRankUnderShrinkSurvivorsContinue) {
  KILN_SKIP_WITHOUT_GLOO();
  const std::string dir = fresh_test_dir("fault_shrink");
  const auto t0 = Clock::now();
  const auto r = run_ranks(4, "killed", "KILN_TEST_TIMEOUT_MS=5000 " + GetParam(), "--policy shrink --log-dir " + dir);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "policy shrink: continuing without rank(s) 1 as 'world' generation 1 of 3 ranks"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] survivor: old rank 0 new rank 0 of 3 generation 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 2] survivor: old rank 2 new rank 1 of 3 generation 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 3] survivor: old rank 3 new rank 2 of 3 generation 1")) << r.output;
  size_t ok = 0;
  for (size_t p = 0; (p = r.output.find("survivor ok", p)) != std::string::npos; ++p) ++ok;
  EXPECT_EQ(ok, 3u) << r.output;
  EXPECT_LT(secs, 20) << r.output;
  const auto events = run_command("cat " + dir + "/rank0.jsonl").output;
  EXPECT_TRUE(contains(events, "\"event\":\"shrink\"")) << events;
  expect_path(dir);
}
