// The Gloo backend with real processes through kiln launch, at world sizes 1 to 4: every
// collective x dtype x reduction against the serial reference (sizes 0, 1, 7, 33, uneven
// all_to_all, in place), several operations in flight on two communicators, split, and bad
// input. The ranks are DistWorker.Run (comm_worker.cpp) of this same test program.
#include <gtest/gtest.h>

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

TEST(Gloo, BadInputNamesOpAndValuesAndCommunicatorStaysUsable) {
  KILN_SKIP_WITHOUT_GLOO();
  const auto r = run_ranks(2, "bad_input");
  EXPECT_EQ(r.status, 0) << r.output;
}
