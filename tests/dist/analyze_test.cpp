// kiln comms analyze on hand-made flight-recorder dumps: a rank issuing an extra all_reduce, a
// size mismatch, a dtype mismatch, a rank that has a dump but never joined an op, a rank that
// left no dump at all (the world size and the members come from the other dumps' metadata), the
// same in a split communicator whose ranks are not the job's, dumps of the first format (no
// metadata), a clean run, and malformed dumps; the outputs (text, and JSON for some cases) must
// equal tests/dist/golden/. KILN_UPDATE_GOLDEN=1 rewrites the golden files.
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "kiln/dist/flight_recorder.h"
#include "kiln/io/json.h"
#include "tests/dist/dist_test_util.h"

using namespace kiln;
using namespace kiln::dist::test;

namespace {

struct E {
  int seq;
  const char* op;
  int n;
  const char* state = "completed";
  const char* dtype = "f32";
  const char* comm = "world";
};

// A communicator a rank joined: name, size, the job's rank of each member (this rank's place is
// where its own job rank is).
struct C {
  std::string name;
  std::vector<int> members;
};

// A dump as FlightRecorder::to_json writes it (version 2: world size and communicators), or the
// first format (version 1: neither) when `comms` is null.
std::string dump(int rank, int world, const std::vector<C>* comms, const std::vector<E>& entries) {
  json::Value d = json::Value::object();
  d["version"] = comms ? 2 : 1;
  d["rank"] = rank;
  if (comms) d["world_size"] = world;
  d["pid"] = 1;
  d["reason"] = "timeout";
  d["time"] = 0;
  auto rank_in = [&](const std::string& comm) {
    if (comms)
      for (const auto& c : *comms)
        if (c.name == comm)
          for (size_t i = 0; i < c.members.size(); ++i)
            if (c.members[i] == rank) return std::pair<int, int>(static_cast<int>(i), static_cast<int>(c.members.size()));
    return std::pair<int, int>(rank, world);
  };
  if (comms) {
    json::Value cs = json::Value::array();
    for (const auto& c : *comms) {
      json::Value j = json::Value::object();
      j["comm"] = c.name;
      j["generation"] = 0;
      j["rank"] = rank_in(c.name).first;
      j["size"] = static_cast<int64_t>(c.members.size());
      json::Value m = json::Value::array();
      for (int r : c.members) m.push_back(static_cast<int64_t>(r));
      j["ranks"] = std::move(m);
      cs.push_back(std::move(j));
    }
    d["comms"] = std::move(cs);
  }
  json::Value es = json::Value::array();
  for (size_t i = 0; i < entries.size(); ++i) {
    const E& e = entries[i];
    const auto [r, size] = rank_in(e.comm);
    const bool gather = std::string(e.op) == "all_gather";
    json::Value j = json::Value::object();
    j["record_id"] = static_cast<int64_t>(i);
    j["comm"] = e.comm;
    j["comm_rank"] = r;
    j["comm_size"] = size;
    j["seq"] = e.seq;
    j["op"] = e.op;
    j["in_numel"] = e.n;
    j["out_numel"] = gather ? e.n * size : e.n;
    j["dtype"] = e.dtype;
    j["timeout_ms"] = 1000;
    j["time_enqueued"] = 1;
    j["state"] = e.state;
    es.push_back(std::move(j));
  }
  d["entries"] = std::move(es);
  return d.dump();
}

void write_dump(const std::string& dir, int rank, const std::string& text) {
  std::ofstream(dir + "/kiln_fr_rank" + std::to_string(rank) + ".json") << text;
}

// Ranks 0..per_rank.size()-1 of a world of `size` over one communicator 'world'; a rank whose
// list is empty left no dump. legacy: dumps of the first format.
std::string write_case(const std::string& name, const std::vector<std::vector<E>>& per_rank, int size,
                       bool legacy = false) {
  const std::string dir = fresh_test_dir("analyze_" + name);
  std::vector<C> comms = {{"world", {}}};
  for (int r = 0; r < size; ++r) comms[0].members.push_back(r);
  for (size_t r = 0; r < per_rank.size(); ++r)
    if (!per_rank[r].empty()) write_dump(dir, static_cast<int>(r), dump(static_cast<int>(r), size, legacy ? nullptr : &comms, per_rank[r]));
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
  expect_golden(dir, "extra_all_reduce.json", "--json", 1);
}

TEST(CommsAnalyze, SizeMismatch) {
  const std::vector<E> ok = {{1, "all_reduce", 8}, {2, "broadcast", 16, "timed_out"}};
  const auto dir = write_case("size", {ok, ok, {{1, "all_reduce", 8}, {2, "broadcast", 15, "timed_out"}}}, 3);
  expect_golden(dir, "size_mismatch.txt", "", 1);
  expect_golden(dir, "size_mismatch.json", "--json", 1);
}

TEST(CommsAnalyze, DtypeMismatch) {
  const std::vector<E> ok = {{1, "all_reduce", 8}, {2, "all_reduce", 8, "timed_out", "bf16"}};
  const auto dir = write_case("dtype", {ok, {{1, "all_reduce", 8}, {2, "all_reduce", 8, "timed_out", "f32"}}}, 2);
  expect_golden(dir, "dtype_mismatch.txt", "", 1);
  expect_golden(dir, "dtype_mismatch.json", "--json", 1);
}

TEST(CommsAnalyze, RankWithADumpThatNeverJoined) {
  // Rank 2 stopped after #16 (its dump says so); ranks 0, 1 timed out in all_reduce #17.
  std::vector<E> a, b;
  for (int s = 1; s <= 16; ++s) a.push_back({s, "all_reduce", 4});
  b = a;
  a.push_back({17, "all_reduce", 4, "timed_out"});
  const auto dir = write_case("missing", {a, a, b}, 3);
  expect_golden(dir, "missing_rank.txt", "", 1);
}

TEST(CommsAnalyze, RankThatLeftNoDump) {
  // Rank 2 slept past the timeout and was killed by the launcher: no dump. Ranks 0, 1 completed
  // 'world' #1, #2 and 16 all_reduces of 'fsdp', and timed out in 'fsdp' #17. The analyzer knows
  // from their dumps that the job has 3 ranks and that rank 2 is a member of both.
  const std::string dir = fresh_test_dir("analyze_no_dump");
  const std::vector<C> comms = {{"world", {0, 1, 2}}, {"fsdp", {0, 1, 2}}};
  std::vector<E> a = {{1, "barrier", 0, "completed", ""}, {2, "all_reduce", 1}};
  for (int s = 1; s <= 16; ++s) a.push_back({s, "all_reduce", 64, "completed", "f32", "fsdp"});
  a.push_back({17, "all_reduce", 64, "timed_out", "f32", "fsdp"});
  write_dump(dir, 0, dump(0, 3, &comms, a));
  write_dump(dir, 1, dump(1, 3, &comms, a));
  expect_golden(dir, "no_dump.txt", "", 1);
  expect_golden(dir, "no_dump.json", "--json", 1);
}

TEST(CommsAnalyze, RankThatLeftNoDumpInASplitNamesTheJobRank) {
  // A job of 4; 'odd' is split as [3, 1] (its rank 0 is the job's rank 3). Job rank 3 left no
  // dump; rank 1 waits in 'odd' #5. The finding names both numbers.
  const std::string dir = fresh_test_dir("analyze_split");
  const std::vector<C> all = {{"world", {0, 1, 2, 3}}};
  const std::vector<C> odd = {{"world", {0, 1, 2, 3}}, {"odd", {3, 1}}};
  const std::vector<E> w = {{1, "all_reduce", 2}};
  std::vector<E> o = w;
  for (int s = 1; s <= 4; ++s) o.push_back({s, "all_gather", 8, "completed", "bf16", "odd"});
  o.push_back({5, "all_gather", 8, "timed_out", "bf16", "odd"});
  write_dump(dir, 0, dump(0, 4, &all, w));
  write_dump(dir, 1, dump(1, 4, &odd, o));
  write_dump(dir, 2, dump(2, 4, &all, w));
  expect_golden(dir, "split_no_dump.txt", "", 1);
}

TEST(CommsAnalyze, FirstFormatDumpsStillNameTheRankWithoutADump) {
  // Dumps without metadata (version 1): the size comes from the entries' comm_size. Rank 2 left
  // none; the others must not read as "every rank joined".
  std::vector<E> a = {{1, "all_reduce", 4}, {2, "all_reduce", 4, "timed_out"}};
  const auto dir = write_case("legacy", {a, a}, 3, /*legacy=*/true);
  expect_golden(dir, "first_format_no_dump.txt", "", 1);
}

TEST(CommsAnalyze, CleanRunAndBadFolder) {
  const std::vector<E> ok = {{1, "all_reduce", 8}, {2, "barrier", 0}};
  const auto dir = write_case("clean", {ok, ok}, 2);
  expect_golden(dir, "clean.txt", "", 0);
  const auto r = run_command(kiln_cli() + " comms analyze " + ::testing::TempDir() + "kiln_no_such_dir", 20);
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(contains(r.output, "cannot open folder")) << r.output;
}

TEST(CommsAnalyze, MalformedDumpsAreErrorsNamingTheProblem) {
  const std::string dir = fresh_test_dir("analyze_malformed");
  write_dump(dir, 0, R"({"version": 2, "rank": 0, "world_size": 2, "entries": [{"comm": "world", "comm_rank": 0,
      "comm_size": 2, "op": "all_reduce", "in_numel": 1, "out_numel": 1, "dtype": "f32", "state": "completed"}]})");
  auto r = run_command(kiln_cli() + " comms analyze " + dir, 20);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "an entry has no \"seq\"")) << r.output;
  write_dump(dir, 0, R"({"version": 2, "rank": 0, "world_size": 2, "entries": [{"comm": "world", "comm_rank": 5,
      "comm_size": 2, "seq": 1, "op": "all_reduce", "in_numel": 1, "out_numel": 1, "dtype": "f32", "state": "completed"}]})");
  r = run_command(kiln_cli() + " comms analyze " + dir, 20);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "comm_rank 5 of comm_size 2")) << r.output;
  write_dump(dir, 0, R"({"version": 2, "rank": 1, "world_size": 2, "entries": []})");
  write_dump(dir, 1, R"({"version": 2, "rank": 1, "world_size": 2, "entries": []})");
  r = run_command(kiln_cli() + " comms analyze " + dir, 20);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "two dumps say they are rank 1")) << r.output;
  write_dump(dir, 0, "{\"version\": 2, \"entries\": [");
  r = run_command(kiln_cli() + " comms analyze " + dir, 20);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "kiln_fr_rank0.json")) << r.output;
}

// What a real dump says of its communicators: a one-rank Gloo world and a split of it, and the
// members a split or a sub-world communicator records.
TEST(FlightRecorderDump, CarriesWorldSizeAndMembership) {
  KILN_SKIP_WITHOUT_GLOO();
  LocalStore local("fr-meta");
  auto world = kiln::dist::new_gloo_communicator(local.store, 0, 1, "fr_meta");
  auto solo = world->split({0}, "fr_meta_solo");
  solo->barrier()->wait();
  const json::Value d = kiln::dist::FlightRecorder::instance().to_json("request");
  EXPECT_EQ(d.find("version")->as_int(), 2);
  EXPECT_GE(d.find("world_size")->as_int(), 1);
  int found = 0;
  for (const auto& c : d.find("comms")->as_array()) {
    const std::string name = c.find("comm")->as_string();
    if (name != "fr_meta" && name != "fr_meta_solo") continue;
    ++found;
    EXPECT_EQ(c.find("size")->as_int(), 1);
    EXPECT_EQ(c.find("rank")->as_int(), 0);
    ASSERT_EQ(c.find("ranks")->as_array().size(), 1u);
  }
  EXPECT_EQ(found, 2);
  // Members: the identity over the whole job; a split maps through its parent; a communicator
  // that is not the whole job knows only this process's place.
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "4", 1);
  EXPECT_EQ(kiln::dist::root_members(2, 4), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(kiln::dist::root_members(0, 2), (std::vector<int>{2, -1}));
  EXPECT_EQ(kiln::dist::split_members({0, 1, 2, 3}, {3, 1}), (std::vector<int>{3, 1}));
  EXPECT_EQ(kiln::dist::split_members({5, 7}, {1, 0, 9}), (std::vector<int>{7, 5, -1}));
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
}
