// The Gloo backend with real processes through kiln launch, at world sizes 1 to 4: every
// collective x dtype x reduction against the serial reference (sizes 0, 1, 7, 33, uneven
// all_to_all, in place), several operations in flight on two communicators, split, and bad
// input. The ranks are DistWorker.Run (comm_worker.cpp) of this same test program.
#include <gtest/gtest.h>

#include "tests/dist/dist_test_util.h"

using namespace kiln::dist::test;

namespace {
std::string self() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return std::string(buf, n > 0 ? static_cast<size_t>(n) : 0);
}
RunResult run_ranks(int n, const std::string& worker, const std::string& env = "", const std::string& flags = "",
                    int deadline_s = 90) {
  return run_command("env KILN_TEST_WORKER=" + worker + " " + env + " " + kiln_cli() + " launch --nproc-per-node " +
                         std::to_string(n) + " --master-port 0 --term-grace 1 " + flags + " -- " + self() +
                         " --gtest_filter=DistWorker.Run --gtest_brief=1",
                     deadline_s);
}
}  // namespace

class GlooWorld : public ::testing::TestWithParam<int> {};

TEST_P(GlooWorld, EveryCollectiveAndDtypeMatchesSerialReference) {
  const auto r = run_ranks(GetParam(), "collectives");
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST_P(GlooWorld, OpsInFlightOnTwoCommunicatorsAndSplit) {
  const auto r = run_ranks(GetParam(), "in_flight");
  EXPECT_EQ(r.status, 0) << r.output;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooWorld, ::testing::Values(1, 2, 3, 4));

TEST(Gloo, BadInputNamesOpAndValuesAndCommunicatorStaysUsable) {
  const auto r = run_ranks(2, "bad_input");
  EXPECT_EQ(r.status, 0) << r.output;
}
