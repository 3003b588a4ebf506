// The Gloo backend with real processes through kiln launch, at world sizes 1 to 4: every
// collective x dtype x reduction against the serial reference (sizes 0, 1, 7, 33, uneven
// all_to_all, in place), several operations in flight on two communicators, split, and bad
// input. The ranks are DistWorker.Run (comm_worker.cpp) of this same test program.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include "tests/dist/dist_test_util.h"

using namespace kiln::dist::test;

class GlooWorld : public ::testing::TestWithParam<int> {};

TEST_P(GlooWorld, EveryCollectiveAndDtypeMatchesSerialReference) {
  KILN_SKIP_WITHOUT_GLOO();
  const auto r = run_ranks(GetParam(), "collectives");
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST_P(GlooWorld, OpsInFlightOnTwoCommunicatorsAndSplit) {
  KILN_SKIP_WITHOUT_GLOO();
  const auto r = run_ranks(GetParam(), "in_flight");
  EXPECT_EQ(r.status, 0) << r.output;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooWorld, ::testing::Values(1, 2, 3, 4));

// all_reduce, all_gather and reduce_scatter among ranks of one host take the shared-memory segment
// (every case above); with KILN_GLOO_SHM=0, all_reduce takes the direct exchange up to
// KILN_GLOO_DIRECT_BYTES (the tiny tensors) and Gloo's ring above it. Each path checked here, the
// ring with small segments, the segment with its smallest slots (64 bytes x the ranks: the
// 33-element cases take several steps of uneven parts); each run's init event says whether the
// segment was on.
static void check_collectives_path(int ranks, const std::string& env, const std::string& shm_event) {
  const std::string dir = fresh_test_dir("gloo_path");
  const auto r = run_ranks(ranks, "collectives", env, "--log-dir " + dir);
  EXPECT_EQ(r.status, 0) << r.output;
  const auto events = run_command("cat " + dir + "/rank" + std::to_string(ranks - 1) + ".jsonl").output;
  EXPECT_TRUE(contains(events, "\"shared_memory\":\"" + shm_event + "\"")) << events;
}

TEST(Gloo, RingAllReducePathMatchesSerialReference) {
  KILN_SKIP_WITHOUT_GLOO();
  check_collectives_path(3, "KILN_GLOO_SHM=0 KILN_GLOO_DIRECT_BYTES=0 KILN_GLOO_SEGMENT_BYTES=8", "off: KILN_GLOO_SHM=0");
}

TEST(Gloo, DirectAllReducePathMatchesSerialReference) {
  KILN_SKIP_WITHOUT_GLOO();
  check_collectives_path(3, "KILN_GLOO_SHM=0", "off: KILN_GLOO_SHM=0");
}

// The segment serves all_gather and reduce_scatter too: the collectives case runs each in
// several steps at this chunk.
TEST(Gloo, SharedMemoryPathMatchesSerialReference) {
  KILN_SKIP_WITHOUT_GLOO();
  KILN_SKIP_WITHOUT_SHM();
  for (int n : {2, 4}) check_collectives_path(n, "KILN_GLOO_SHM_CHUNK_BYTES=64", "on");
}

// Ranks calling different ops of one count fail naming each other's call (the tag every rank
// compares names the op: a sum all_reduce and an all_gather of one dtype differ).
TEST(Gloo, RanksCallingDifferentOpsInTheSegmentFail) {
  KILN_SKIP_WITHOUT_GLOO();
  KILN_SKIP_WITHOUT_SHM();
  const auto r = run_ranks(2, "mixed_ops", "KILN_TEST_TIMEOUT_MS=20000");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] mixed ops failed as expected")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] mixed ops failed as expected")) << r.output;
}

TEST(Gloo, BadInputNamesOpAndValuesAndCommunicatorStaysUsable) {
  KILN_SKIP_WITHOUT_GLOO();
  const auto r = run_ranks(2, "bad_input");
  EXPECT_EQ(r.status, 0) << r.output;
}

// Gloo's TCP pairs write without MSG_NOSIGNAL: a survivor writing to a killed peer must get EPIPE
// (and fail the op with a message), not die of SIGPIPE. Creating a Gloo communicator makes a
// default SIGPIPE ignored; a handler the program installed stays.
TEST(Gloo, ACommunicatorTurnsTheDefaultSigpipeIntoEpipe) {
  KILN_SKIP_WITHOUT_GLOO();
  auto sigpipe_handler = [] {
    struct sigaction now {};
    sigaction(SIGPIPE, nullptr, &now);
    return now.sa_handler;
  };
  auto one_rank_world = [] {
    LocalStore local("sigpipe-test");
    kiln::dist::new_gloo_communicator(local.store, 0, 1, "sigpipe")->barrier()->wait();
  };
  signal(SIGPIPE, SIG_DFL);
  one_rank_world();
  EXPECT_EQ(sigpipe_handler(), SIG_IGN);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  close(fds[0]);
  const char byte = 0;
  EXPECT_EQ(write(fds[1], &byte, 1), -1);  // the process is still here to see it
  EXPECT_EQ(errno, EPIPE);
  close(fds[1]);

  static void (*const mine)(int) = [](int) {};
  signal(SIGPIPE, mine);
  one_rank_world();
  EXPECT_EQ(sigpipe_handler(), mine);
  signal(SIGPIPE, SIG_DFL);
}

// A world of one has no peer to wait for: each op runs as it is issued (nothing queued ahead),
// on the calling thread, so its Work is complete when the call returns; results as the serial
// reference (the sum of one rank is its tensor, the gather its slice).
TEST(Gloo, AWorldOfOneRunsEachOpAsItIsIssued) {
  KILN_SKIP_WITHOUT_GLOO();
  LocalStore local("one-rank-test");
  auto world = kiln::dist::new_gloo_communicator(local.store, 0, 1, "one");
  kiln::Tensor t = kiln::from_vector(std::vector<float>{1, 2, 3}, {3});
  auto w = world->all_reduce(t, kiln::dist::ReduceOp::sum);
  EXPECT_TRUE(w->is_completed());
  w->wait();
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1, 2, 3}));
  kiln::Tensor out = kiln::Tensor::empty({3});
  auto g = world->all_gather_single(out, t);
  EXPECT_TRUE(g->is_completed());
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{1, 2, 3}));
  kiln::Tensor half = kiln::Tensor::empty({3});
  auto s = world->reduce_scatter_single(half, out, kiln::dist::ReduceOp::avg);
  EXPECT_TRUE(s->is_completed());
  EXPECT_EQ(half.to_vector<float>(), (std::vector<float>{1, 2, 3}));
}
