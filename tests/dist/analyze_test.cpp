// kiln comms analyze on hand-made flight-recorder dumps of three ranks: a rank issuing an extra
// all_reduce, a size mismatch, a missing rank, and a clean run; the outputs (text, and JSON for
// one case) must equal tests/dist/golden/. KILN_UPDATE_GOLDEN=1 rewrites the golden files.
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "tests/dist/dist_test_util.h"

using namespace kiln::dist::test;

namespace {

struct E {
  int seq;
  const char* op;
  int n;
  const char* state = "completed";
  const char* dtype = "f32";
};

std::string dump(int rank, int size, const std::vector<E>& entries) {
  std::ostringstream s;
  s << "{\"version\": 1, \"rank\": " << rank << ", \"pid\": 1, \"reason\": \"timeout\", \"time\": 0, \"entries\": [";
  for (size_t i = 0; i < entries.size(); ++i) {
    const E& e = entries[i];
    const bool gather = std::string(e.op) == "all_gather";
    s << (i ? "," : "") << "{\"record_id\": " << i << ", \"comm\": \"world\", \"comm_rank\": " << rank
      << ", \"comm_size\": " << size << ", \"seq\": " << e.seq << ", \"op\": \"" << e.op << "\", \"in_numel\": " << e.n
      << ", \"out_numel\": " << (gather ? e.n * size : e.n) << ", \"dtype\": \"" << e.dtype
      << "\", \"timeout_ms\": 1000, \"time_enqueued\": 1, \"state\": \"" << e.state << "\"}";
  }
  s << "]}";
  return s.str();
}

std::string write_case(const std::string& name, const std::vector<std::vector<E>>& per_rank, int size) {
  const std::string dir = ::testing::TempDir() + "kiln_analyze_" + name;
  run_command("rm -rf " + dir + " && mkdir -p " + dir);
  for (size_t r = 0; r < per_rank.size(); ++r)
    if (!per_rank[r].empty())
      std::ofstream(dir + "/kiln_fr_rank" + std::to_string(r) + ".json") << dump(static_cast<int>(r), size, per_rank[r]);
  return dir;
}

void expect_golden(const std::string& dir, const std::string& golden, const std::string& flags, int want_status) {
  const auto r = run_command(kiln_cli() + " comms analyze " + dir + " " + flags, 20);
  EXPECT_EQ(r.status, want_status) << r.output;
  const std::string path = std::string(KILN_SOURCE_DIR) + "/tests/dist/golden/" + golden;
  if (std::getenv("KILN_UPDATE_GOLDEN")) std::ofstream(path) << r.output;
  std::ifstream in(path);
  std::stringstream want;
  want << in.rdbuf();
  EXPECT_EQ(r.output, want.str()) << "golden " << path;
}

}  // namespace

TEST(CommsAnalyze, ExtraAllReduceOnOneRank) {
  // Rank 0 issued an extra all_reduce #3; ranks 1, 2 went on to all_gather #3.
  const std::vector<E> others = {{1, "all_reduce", 8}, {2, "all_reduce", 8}, {3, "all_gather", 4, "timed_out"}};
  const auto dir = write_case("extra", {{{1, "all_reduce", 8}, {2, "all_reduce", 8}, {3, "all_reduce", 8, "timed_out"}},
                                        others, others}, 3);
  expect_golden(dir, "extra_all_reduce.txt", "", 1);
}

TEST(CommsAnalyze, SizeMismatch) {
  const std::vector<E> ok = {{1, "all_reduce", 8}, {2, "broadcast", 16, "timed_out"}};
  const auto dir = write_case("size", {ok, ok, {{1, "all_reduce", 8}, {2, "broadcast", 15, "timed_out"}}}, 3);
  expect_golden(dir, "size_mismatch.txt", "", 1);
  expect_golden(dir, "size_mismatch.json", "--json", 1);
}

TEST(CommsAnalyze, MissingRank) {
  // Rank 2 stopped after #16; ranks 0, 1 timed out in all_reduce #17.
  std::vector<E> a, b;
  for (int s = 1; s <= 16; ++s) a.push_back({s, "all_reduce", 4});
  b = a;
  a.push_back({17, "all_reduce", 4, "timed_out"});
  const auto dir = write_case("missing", {a, a, b}, 3);
  expect_golden(dir, "missing_rank.txt", "", 1);
}

TEST(CommsAnalyze, CleanRunAndBadFolder) {
  const std::vector<E> ok = {{1, "all_reduce", 8}, {2, "barrier", 0}};
  const auto dir = write_case("clean", {ok, ok}, 2);
  expect_golden(dir, "clean.txt", "", 0);
  const auto r = run_command(kiln_cli() + " comms analyze " + ::testing::TempDir() + "kiln_no_such_dir", 20);
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(contains(r.output, "cannot open folder")) << r.output;
}
