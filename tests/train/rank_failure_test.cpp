// Training that survives a lost rank (issue 32 item 4), with real processes through kiln train
// --nproc 3 (kiln/dist's launcher, Gloo on 127.0.0.1): rank 1 kills itself with SIGKILL after
// step 10 (KILN_TEST_KILL_AT, on the job's first attempt only). Under --on-failure restart the
// launcher restarts every rank, the ranks resume from the run folder's latest sharded checkpoint
// (step 8) by themselves, and steps 9..14 are bitwise those of an uninterrupted 3-rank run;
// under shrink the two survivors reload step 8 resharded to 2 ranks and finish at N = 2 with the
// same global batch (the curve within 1e-5 of one process's), and metrics.jsonl records the event.
// Also: the sample at the end of a sharded run is rank 0's generation from the gathered
// parameters, a damaged `latest` falls back to the newest whole sharded checkpoint, and bad
// --nproc / --on-failure / --max-restarts values are errors naming them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/core/switches.h"
#include "kiln/data/tokenizer.h"
#include "kiln/io/json.h"
#include "kiln/nn/generate.h"
#include "kiln/parallel/dcp.h"
#include "kiln/train/checkpoint.h"
#include "tests/cli_run.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

struct Metrics {
  std::vector<json::Value> steps;   // records with a loss, in file order
  std::vector<json::Value> events;  // records with an "event"
};

Metrics metrics_of(const fs::path& run) {
  Metrics m;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    json::Value v = json::parse(line);
    (v.find("event") ? m.events : m.steps).push_back(v);
  }
  return m;
}

// 14 steps, a checkpoint every 4; --batch 1 and --global-batch 6: 2 micro-batches per rank at
// N = 3, 3 at N = 2, 6 in one process (the same sequences per step at every N).
std::string flags(const fs::path& out) {
  return "train --preset tiny --hidden 32 --heads 4 --kv-heads 2 --intermediate 64 --layers 2 --seq 32 --batch 1 "
         "--global-batch 6 --steps 14 --eval-every 0 --ckpt-every 4 --deterministic --seed 7 --log-every 1 --out " +
         out.string();
}

// Short communicator timeouts, so that a test that goes wrong ends in seconds, not in 600.
struct Env {
  explicit Env(const char* kill_at) {
    ::setenv("KILN_DIST_TIMEOUT", "30", 1);
    if (kill_at) ::setenv("KILN_TEST_KILL_AT", kill_at, 1);
  }
  ~Env() {
    ::unsetenv("KILN_DIST_TIMEOUT");
    ::unsetenv("KILN_TEST_KILL_AT");
  }
};

bool no_gloo(const test::CliOutcome& r) { return r.output.find("without Gloo") != std::string::npos; }

// The text between the "--- sample ---" lines rank 0 printed ("" when there is none).
std::string sample_of(const std::string& out) {
  std::string rank0;  // rank 0's lines without the launcher's prefix
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("[rank 0] ", 0) == 0) rank0 += line.substr(9) + "\n";
  const std::string open = "--- sample ---\n", close = "\n--------------";
  const size_t a = rank0.find(open);
  if (a == std::string::npos) return "";
  const size_t b = rank0.find(close, a);
  return rank0.substr(a + open.size(), b - a - open.size());
}

}  // namespace

TEST(TrainRanks, RestartAfterAKilledRankResumesFromTheLatestCheckpoint) {
  const fs::path d = test::temp_dir("restart");
  test::CliOutcome ref, run;
  {
    Env env(nullptr);
    ref = test::run_kiln(flags(d / "ref") + " --sample-tokens 8 --nproc 3");
  }
  if (no_gloo(ref)) GTEST_SKIP() << "built without Gloo";
  ASSERT_EQ(ref.status, 0) << ref.output;
  {
    Env env("1:10");
    run = test::run_kiln(flags(d / "run") + " --sample-tokens 0 --nproc 3 --max-restarts 1");
  }
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_NE(run.output.find("rank 1 (pid"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("signal 9 (SIGKILL)"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("restarting every rank (restart 1 of 1)"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("restart 1 of the job: continuing from " + (d / "run" / "step-8").string() + " at step 8"),
            std::string::npos) << run.output;
  const Metrics a = metrics_of(d / "ref"), b = metrics_of(d / "run");
  ASSERT_EQ(a.steps.size(), 14u);
  ASSERT_EQ(b.steps.size(), 14u) << "steps 9 and 10 of the first attempt are dropped, then written again";
  for (size_t i = 0; i < 14; ++i) {
    EXPECT_EQ(b.steps[i].find("step")->as_int(), static_cast<int64_t>(i) + 1);
    // the same 3 ranks from the same sharded checkpoint, deterministic: bitwise
    EXPECT_EQ(b.steps[i].find("loss")->dump(), a.steps[i].find("loss")->dump()) << "step " << i + 1;
    EXPECT_EQ(b.steps[i].find("grad_norm")->dump(), a.steps[i].find("grad_norm")->dump()) << "step " << i + 1;
  }
  ASSERT_EQ(b.events.size(), 1u);
  const json::Value& ev = b.events[0];
  EXPECT_EQ(ev.find("event")->as_string(), "restart");
  EXPECT_EQ(ev.find("step")->as_int(), 8);
  EXPECT_EQ(ev.find("restart_count")->as_int(), 1);
  EXPECT_EQ(ev.find("world_size")->as_int(), 3);
  EXPECT_TRUE(a.events.empty());

  // The sample at the end of the sharded run: rank 0's, from the gathered parameters (those of
  // the last checkpoint, consolidated here), printed once.
  const std::string sample = sample_of(ref.output);
  ASSERT_FALSE(sample.empty()) << ref.output;
  EXPECT_EQ(ref.output.find("--- sample ---", ref.output.find("--- sample ---") + 1), std::string::npos);
  {
    const fs::path last = d / "ref" / "step-14";
    auto model = std::make_unique<nn::LlamaForCausalLM>(
        nn::LlamaConfig::from_json(train::read_json_file((last / "config.json").string())), 7);
    std::vector<std::pair<std::string, Tensor>> weights;
    for (auto& [name, t] : parallel::load_full(last.string()))
      if (name.rfind("exp_avg", 0) != 0) weights.emplace_back(name, t);
    train::load_model_state(*model, weights);
    model->eval();
    set_deterministic(true);  // as the run (--deterministic)
    auto tok = data::load_tokenizer("byte");
    std::vector<int32_t> ids;
    if (tok->bos_id() >= 0) ids.push_back(tok->bos_id());
    for (int32_t t : tok->encode("kiln ")) ids.push_back(t);
    nn::GenerateOptions go;
    go.max_new_tokens = 8;
    go.temperature = 0.8;
    go.top_k = 40;
    go.seed = 7;
    go.eos_id = tok->eos_id();
    EXPECT_EQ(sample, data::displayable("kiln " + tok->decode_continuation(ids, nn::generate(*model, ids, go))));
  }

  // A damaged `latest` of a sharded run: the newest whole checkpoint, with a note; one whose
  // shard file is gone is not whole.
  std::ofstream(d / "ref" / "latest") << "step-";
  std::string note;
  EXPECT_EQ(train::find_checkpoint((d / "ref").string(), &note), (d / "ref" / "step-14").string());
  EXPECT_NE(note.find("using the newest whole checkpoint there"), std::string::npos) << note;
  fs::remove(d / "ref" / "step-14" / "shard-00002-of-00003.safetensors");
  EXPECT_EQ(train::find_checkpoint((d / "ref").string()), (d / "ref" / "step-12").string());
  const test::CliOutcome resumed = test::run_kiln("train --resume " + (d / "ref").string() +
                                                  " --steps 14 --sample-tokens 0 --out " + (d / "ref").string());
  EXPECT_EQ(resumed.status, 0) << resumed.output;  // one process, from step-12 (sharded, consolidated)
  EXPECT_NE(resumed.output.find("resumed at step 12"), std::string::npos) << resumed.output;
  fs::remove_all(d);
}

TEST(TrainRanks, ShrinkAfterAKilledRankFinishesOnTheSurvivors) {
  const fs::path d = test::temp_dir("shrink");
  test::CliOutcome one, run;
  {
    Env env(nullptr);
    one = test::run_kiln(flags(d / "one") + " --sample-tokens 0");
  }
  ASSERT_EQ(one.status, 0) << one.output;
  {
    Env env("1:10");
    run = test::run_kiln(flags(d / "run") + " --sample-tokens 0 --nproc 3 --on-failure shrink");
  }
  if (no_gloo(run)) GTEST_SKIP() << "built without Gloo";
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_NE(run.output.find("policy shrink: the other ranks go on without rank 1"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("the surviving ranks finished (rank 1 failed)"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("rank(s) 1 lost at step 10: going on with 2 ranks from " +
                            (d / "run" / "step-8").string() + " (step 8)"), std::string::npos) << run.output;
  const Metrics a = metrics_of(d / "one"), b = metrics_of(d / "run");
  ASSERT_EQ(a.steps.size(), 14u);
  ASSERT_EQ(b.steps.size(), 14u) << "steps 9 and 10 at N = 3 are dropped, then written again at N = 2";
  for (size_t i = 0; i < 14; ++i) {
    EXPECT_EQ(b.steps[i].find("step")->as_int(), static_cast<int64_t>(i) + 1);
    const double la = a.steps[i].find("loss")->as_double(), lb = b.steps[i].find("loss")->as_double();
    EXPECT_NEAR(lb, la, 1e-5 * std::abs(la)) << "step " << i + 1;
    EXPECT_EQ(b.steps[i].find("tokens")->as_int(), a.steps[i].find("tokens")->as_int()) << "the global batch";
  }
  ASSERT_EQ(b.events.size(), 1u);
  const json::Value& ev = b.events[0];
  EXPECT_EQ(ev.find("event")->as_string(), "shrink");
  EXPECT_EQ(ev.find("step")->as_int(), 8);
  EXPECT_EQ(ev.find("failed_at_step")->as_int(), 10);
  EXPECT_EQ(ev.find("lost_ranks")->dump(), "[1]");
  EXPECT_EQ(ev.find("world_size")->as_int(), 2);
  EXPECT_GT(ev.find("seconds_lost")->as_double(), 0);
  // the checkpoints after the shrink are sharded over the 2 survivors
  const fs::path last = d / "run" / "step-14";
  EXPECT_TRUE(fs::exists(last / "shard-00001-of-00002.safetensors")) << run.output;
  EXPECT_FALSE(fs::exists(last / "shard-00002-of-00003.safetensors"));
  fs::remove_all(d);
}

// Two ranks lost in turn: rank 2 after step 10 (back to step 8 at N = 2), then rank 0 after
// step 13 (back to step 12 at N = 1: rank 1, now rank 0, takes over the run folder).
TEST(TrainRanks, ShrinkTwiceEndsOnTheLastRank) {
  const fs::path d = test::temp_dir("shrink2");
  test::CliOutcome run;
  {
    Env env("2:10,0:13");
    run = test::run_kiln(flags(d / "run") + " --sample-tokens 0 --nproc 3 --on-failure shrink");
  }
  if (no_gloo(run)) GTEST_SKIP() << "built without Gloo";
  ASSERT_EQ(run.status, 0) << run.output;
  const Metrics b = metrics_of(d / "run");
  ASSERT_EQ(b.steps.size(), 14u) << run.output;
  for (size_t i = 0; i < 14; ++i) EXPECT_EQ(b.steps[i].find("step")->as_int(), static_cast<int64_t>(i) + 1);
  ASSERT_EQ(b.events.size(), 2u) << run.output;
  EXPECT_EQ(b.events[0].find("step")->as_int(), 8);
  EXPECT_EQ(b.events[0].find("lost_ranks")->dump(), "[2]");
  EXPECT_EQ(b.events[0].find("world_size")->as_int(), 2);
  EXPECT_EQ(b.events[1].find("step")->as_int(), 12);
  EXPECT_EQ(b.events[1].find("failed_at_step")->as_int(), 13);
  EXPECT_EQ(b.events[1].find("lost_ranks")->dump(), "[0]");
  EXPECT_EQ(b.events[1].find("world_size")->as_int(), 1);
  EXPECT_TRUE(fs::exists(d / "run" / "step-14" / "shard-00000-of-00001.safetensors")) << run.output;
  EXPECT_NE(run.output.find("[rank 1] done after 14 steps"), std::string::npos) << run.output;
  fs::remove_all(d);
}

TEST(TrainRanks, BadFailureSettingsAreErrorsNamingThem) {
  const fs::path d = test::temp_dir("failure_bad");
  test::CliOutcome r = test::run_kiln(flags(d / "a") + " --nproc 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--nproc 0: nproc=0 must be positive"), std::string::npos) << r.output;
  r = test::run_kiln(flags(d / "b") + " --nproc 3 --on-failure bogus");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--on-failure 'bogus' is not one of: restart, shrink"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("starting 3 ranks"), std::string::npos) << "refused before any rank starts";
  r = test::run_kiln(flags(d / "c") + " --nproc 3 --max-restarts -1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--max-restarts -1 must be >= 0"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(d / "a") || fs::exists(d / "b") || fs::exists(d / "c")) << "no run folder";
  // A shrink that cannot keep the global batch: 6 sequences do not split over 2 ranks x --batch 2
  // (3 ranks x 2 = 6 did); the survivors stop with an error naming the numbers.
  Env env("2:3");
  r = test::run_kiln(flags(d / "e") + " --batch 2 --steps 5 --sample-tokens 0 --nproc 3 --on-failure shrink");
  if (no_gloo(r)) GTEST_SKIP() << "built without Gloo";
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank(s) 2 lost at step 3, and the 2 survivors cannot keep the run's global batch of 6 "
                          "sequences: train: the global batch 6 is not a multiple of --batch 2 x 2 rank(s) = 4"),
            std::string::npos) << r.output;
  fs::remove_all(d);
}
