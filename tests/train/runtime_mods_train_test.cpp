// kiln train with run-time FlexAttention mods (issue 36; config.h, trainer_setup.cpp): a
// mask_mod expression that spells the causal or sliding-window mask trains with the library
// mask's loss bits, a score_mod reading a captured tensor from a safetensors file trains (a
// zero bias: the bits of no score_mod), and expressions that do not compile, unknown captures
// and combinations the mods do not support are errors before the first step that leave no run
// folder behind. The JIT compiles with the system C++ compiler (the kernels are cached under the
// test binary's folder).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"
#include "kiln/train/trainer.h"
#include "tests/jit/jit_test_util.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

using test::error_of;

std::vector<uint64_t> bits(const std::vector<double>& v) {
  std::vector<uint64_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(double));
  return b;
}

train::TrainConfig mods_run(const fs::path& out, uint64_t seed) {
  train::TrainConfig c = test::tiny_run(out, 3);
  c.seed = seed;
  c.eval_every = 3;
  c.attention = "flex";
  return c;
}

}  // namespace

TEST(TrainRuntimeMods, ExpressionsOfTheLibraryMasksTrainWithTheirBits) {
  test::use_shared_jit_cache();
  const uint64_t seed = std::random_device{}() % 100000;
  const fs::path d = test::temp_dir("rt_masks");
  for (const auto& [library, expr] : std::vector<std::pair<std::string, std::string>>{
           {"causal", "q_idx >= kv_idx"}, {"window:8", "q_idx >= kv_idx && q_idx - kv_idx < 8"}}) {
    SCOPED_TRACE(library);
    train::TrainConfig a = mods_run(d / "lib", seed);
    a.attention_mask = library;
    a.overwrite = true;
    const train::TrainSummary want = train::run_training(a, test::quiet());
    train::TrainConfig b = mods_run(d / "expr", seed);
    b.attention_mask = expr;
    b.overwrite = true;
    const train::TrainSummary got = train::run_training(b, test::quiet());
    ASSERT_EQ(got.losses.size(), 3u);
    EXPECT_EQ(bits(got.losses), bits(want.losses));
    EXPECT_EQ(got.final_eval_loss, want.final_eval_loss);
  }
  // a resumed run rebuilds its mods from its saved settings
  train::TrainConfig r = mods_run(d / "expr", seed);
  r.resume = (d / "expr").string();
  r.steps = 4;
  const train::TrainSummary more = train::run_training(r, test::quiet());
  EXPECT_EQ(more.start_step, 3);
  EXPECT_EQ(more.steps_done, 4);
  fs::remove_all(d);
}

TEST(TrainRuntimeMods, AScoreModReadsItsCapturesFromAFile) {
  test::use_shared_jit_cache();
  const uint64_t seed = std::random_device{}() % 100000;
  const fs::path d = test::temp_dir("rt_score");
  // an ALiBi-like bias; slopes 0: score + 0 is score, so the run has the bits of the plain causal one
  // (a bias constant per row, as bias[h] alone, would change nothing: softmax ignores shifts)
  io::save_safetensors((d / "caps.safetensors").string(), {{"bias", zeros({4}, DType::f32)}});
  train::TrainConfig plain = mods_run(d / "plain", seed);
  const train::TrainSummary want = train::run_training(plain, test::quiet());
  train::TrainConfig c = mods_run(d / "score", seed);
  c.score_mod = "score + bias[h] * (kv_idx - q_idx)";
  c.captures = (d / "caps.safetensors").string();
  const train::TrainSummary got = train::run_training(c, test::quiet());
  EXPECT_EQ(bits(got.losses), bits(want.losses));
  // real slopes change the run (the captured values reach the kernels)
  Generator gen(seed);
  io::save_safetensors((d / "caps2.safetensors").string(), {{"bias", mul(randn({4}, gen), 2.0)}});
  c.captures = (d / "caps2.safetensors").string();
  c.out = (d / "score2").string();
  const train::TrainSummary other = train::run_training(c, test::quiet());
  EXPECT_NE(bits(other.losses), bits(want.losses));
  EXPECT_TRUE(std::isfinite(other.final_loss));
  fs::remove_all(d);
}

TEST(TrainRuntimeMods, BadExpressionsAndCombinationsFailBeforeTraining) {
  test::use_shared_jit_cache();
  const fs::path d = test::temp_dir("rt_bad");
  train::TrainConfig c = mods_run(d / "run", 1);
  c.score_mod = "score +* 2";
  std::string e = error_of([&] { train::run_training(c, test::quiet()); });
  EXPECT_NE(e.find("train: --score-mod 'score +* 2' does not compile"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl")) << e;
  c.score_mod = "score + slopes[h]";  // names a capture no file gives
  e = error_of([&] { train::run_training(c, test::quiet()); });
  EXPECT_NE(e.find("slopes"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl")) << e;
  c.score_mod.clear();
  c.attention_mask = "casual";  // a typo of causal: compiled as an expression, and said so
  e = error_of([&] { train::run_training(c, test::quiet()); });
  EXPECT_NE(e.find("--attention-mask 'casual' does not compile (an --attention-mask other than auto, causal, "
                   "window:W or document is a mask_mod expression)"), std::string::npos) << e;
  train::TrainConfig v = mods_run(d / "run", 1);
  v.score_mod = "score";
  v.attention = "reference";
  e = error_of([&] { v.validate(); });
  EXPECT_NE(e.find("run on the flex backend"), std::string::npos) << e;
  v.attention = "flex";
  v.sample = "packed";  // auto: the document mask
  e = error_of([&] { v.validate(); });
  EXPECT_NE(e.find("have no document mask"), std::string::npos) << e;
  v = mods_run(d / "run", 1);
  v.captures = "x.safetensors";
  e = error_of([&] { v.validate(); });
  EXPECT_NE(e.find("without a --score-mod"), std::string::npos) << e;
  v = mods_run(d / "run", 1);
  v.score_mod_derivative = "1";
  e = error_of([&] { v.validate(); });
  EXPECT_NE(e.find("score_mod_derivative without a score_mod"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl"));
  fs::remove_all(d);
}
