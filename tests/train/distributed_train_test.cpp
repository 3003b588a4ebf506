// kiln train on several ranks (issue 32 item 2), with real processes: --nproc 2 starts two ranks
// through kiln/dist's launcher (Gloo on the CPU, 127.0.0.1), FSDP-sharded, and with the same
// --global-batch its losses are those of one process within 1e-5 (relative) at every step (the
// same sequences per step: rank r takes its slice of each global batch; only the order of the
// sums differs); rank 0 alone writes metrics.jsonl; the checkpoint is sharded and resumes on 2
// ranks (bitwise) and in one process; bad splits and --nproc 0 are errors naming the numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "kiln/io/json.h"
#include "kiln/parallel/dcp.h"
#include "tests/cli_run.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

std::vector<json::Value> metrics_of(const fs::path& run) {
  std::vector<json::Value> v;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) v.push_back(json::parse(line));
  return v;
}

std::string tiny_flags(const fs::path& out) {
  return "train --preset tiny --hidden 32 --heads 4 --kv-heads 2 --intermediate 64 --layers 2 --seq 32 --batch 2 "
         "--global-batch 8 --steps 4 --eval-every 0 --ckpt-every 2 --sample-tokens 0 --deterministic --seed 91 --out " +
         out.string();
}

}  // namespace

TEST(TrainRanks, TwoRanksMatchOneProcessWithTheSameGlobalBatch) {
  const fs::path d = test::temp_dir("ranks");
  const test::CliOutcome one = test::run_kiln(tiny_flags(d / "ws1"));
  ASSERT_EQ(one.status, 0) << one.output;
  const test::CliOutcome two = test::run_kiln(tiny_flags(d / "ws2") + " --nproc 2");
  if (two.output.find("without Gloo") != std::string::npos) GTEST_SKIP() << "built without Gloo: " << two.output;
  ASSERT_EQ(two.status, 0) << two.output;
  EXPECT_NE(two.output.find("2 ranks (gloo, FSDP-sharded): a global batch of 8 sequences per step, 2 micro-batch(es) "
                            "of 2 per rank"), std::string::npos) << two.output;
  const std::vector<json::Value> a = metrics_of(d / "ws1"), b = metrics_of(d / "ws2");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u) << "rank 0 alone writes the metrics";
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i].find("loss")->as_double(), lb = b[i].find("loss")->as_double();
    EXPECT_NEAR(lb, la, 1e-5 * std::abs(la)) << "step " << i + 1;
    const double ga = a[i].find("grad_norm")->as_double(), gb = b[i].find("grad_norm")->as_double();
    EXPECT_NEAR(gb, ga, 1e-5 * std::abs(ga)) << "step " << i + 1;
    EXPECT_EQ(b[i].find("tokens")->as_int(), a[i].find("tokens")->as_int());  // every rank's tokens
  }
  // the sharded checkpoint, whole over both ranks' files
  const fs::path ck = d / "ws2" / "step-4";
  ASSERT_TRUE(fs::exists(ck / parallel::kShardedIndexFile)) << two.output;
  EXPECT_TRUE(fs::exists(ck / "trainer_state.json"));
  EXPECT_TRUE(fs::exists(ck / "config.json"));
  const auto whole = parallel::load_full(ck.string());
  EXPECT_FALSE(whole.empty());
  // resumed from the sharded step-2 checkpoint, on 2 ranks and in one process: the last two
  // steps of the uninterrupted runs
  const std::string from = (d / "ws2" / "step-2").string();
  const test::CliOutcome r2 =
      test::run_kiln("train --resume " + from + " --steps 4 --sample-tokens 0 --nproc 2 --out " + (d / "r2").string());
  ASSERT_EQ(r2.status, 0) << r2.output;
  const test::CliOutcome r1 =
      test::run_kiln("train --resume " + from + " --steps 4 --sample-tokens 0 --out " + (d / "r1").string());
  ASSERT_EQ(r1.status, 0) << r1.output;
  for (const auto& [run, want] : {std::pair{d / "r2", b}, std::pair{d / "r1", a}}) {
    const std::vector<json::Value> m = metrics_of(run);
    ASSERT_EQ(m.size(), 2u) << run;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(m[i].find("step")->as_int(), static_cast<int64_t>(i) + 3);
      const double l = m[i].find("loss")->as_double(), w = want[i + 2].find("loss")->as_double();
      EXPECT_NEAR(l, w, 1e-5 * std::abs(w)) << run << " step " << i + 3;
    }
  }
  // two ranks resumed on two ranks: bitwise (the shards and the optimizer state are exact)
  EXPECT_EQ(metrics_of(d / "r2")[1].find("loss")->dump(), b[3].find("loss")->dump());
  fs::remove_all(d);
}

// --fsdp at one rank: the sharded path through the launcher and a world of one (what the
// overhead figure of issue 32 measures) gives the one-process run's losses bit for bit (one rank
// sums the loss in the same order; the gradient norm within 1e-12) and writes a sharded checkpoint.
TEST(TrainRanks, FsdpAtOneRankMatchesOneProcessBitwise) {
  const fs::path d = test::temp_dir("ranks_fsdp1");
  const test::CliOutcome one = test::run_kiln(tiny_flags(d / "plain"));
  ASSERT_EQ(one.status, 0) << one.output;
  const test::CliOutcome sharded = test::run_kiln(tiny_flags(d / "fsdp") + " --fsdp");
  if (sharded.output.find("without Gloo") != std::string::npos) GTEST_SKIP() << "built without Gloo: " << sharded.output;
  ASSERT_EQ(sharded.status, 0) << sharded.output;
  EXPECT_NE(sharded.output.find("starting 1 rank ("), std::string::npos) << sharded.output;
  EXPECT_NE(sharded.output.find("1 rank (gloo, FSDP-sharded)"), std::string::npos) << sharded.output;
  const std::vector<json::Value> a = metrics_of(d / "plain"), b = metrics_of(d / "fsdp");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].find("loss")->dump(), a[i].find("loss")->dump()) << "step " << i + 1;
    // the norm sums the shards' squares, then over the world: the last bit of the double may move
    const double ga = a[i].find("grad_norm")->as_double(), gb = b[i].find("grad_norm")->as_double();
    EXPECT_NEAR(gb, ga, 1e-12 * ga) << "step " << i + 1;
  }
  EXPECT_TRUE(fs::exists(d / "fsdp" / "step-4" / parallel::kShardedIndexFile));
  EXPECT_FALSE(fs::exists(d / "plain" / "step-4" / parallel::kShardedIndexFile));
  fs::remove_all(d);
}

TEST(TrainRanks, SplitsThatDoNotDivideAndNoRanksAreErrors) {
  const fs::path d = test::temp_dir("ranks_bad");
  test::CliOutcome r = test::run_kiln(tiny_flags(d / "a") + " --global-batch 6 --nproc 2");
  EXPECT_NE(r.status, 0);
  // The split is checked by each rank once it has joined the world: a build without Gloo (the GPU
  // machine's) refuses the CPU world first, and the two one-process cases below still run.
  if (r.output.find("without Gloo") == std::string::npos)
    EXPECT_NE(r.output.find("--global-batch 6 is not a multiple of --batch 2 x 2 rank(s) = 4"), std::string::npos)
        << r.output;
  r = test::run_kiln(tiny_flags(d / "b") + " --nproc 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("nproc=0 must be positive"), std::string::npos) << r.output;
  r = test::run_kiln(tiny_flags(d / "c") + " --accum 3");  // one process: 8 / 2 = 4 micro-batches, not 3
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--accum 3 disagrees with --global-batch 8"), std::string::npos) << r.output;
  fs::remove_all(d);
}
