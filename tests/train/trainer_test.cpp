// Training tests: the loss falls, runs are bitwise deterministic, a resumed run continues
// bitwise as if never stopped, checkpoints round-trip in Hugging Face's layout, a failed
// checkpoint write leaves the previous one intact, and a sharded HF checkpoint loads.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/profile.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/report.h"
#include "kiln/train/trainer.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

using test::temp_dir;
using test::tiny_run;

using test::logits_of;
using test::quiet;
using test::stop_hooks;

}  // namespace

TEST(Train, StopFlagCheckpointsAndExits) {
  fs::path out = temp_dir("stop");
  std::atomic<bool> stop{true};
  train::TrainSummary s = train::run_training(tiny_run(out, 50), stop_hooks(&stop));
  EXPECT_TRUE(s.interrupted);
  EXPECT_EQ(s.steps_done, 1);
  EXPECT_EQ(train::find_checkpoint(out.string()), (out / "step-1").string());
  fs::remove_all(out);
}

// A diverged run (an absurd --lr) is an error, not "done" with loss nan and exit status 0: a
// short run ends with one after its checkpoint, a long one stops after 10 non-finite steps.
TEST(Train, DivergedRunIsAnError) {
  for (int64_t steps : {3, 40}) {
    SCOPED_TRACE(testing::Message() << "steps=" << steps);
    fs::path out = temp_dir("diverge");
    train::TrainConfig c = tiny_run(out, steps);
    c.lr = 1e30;
    try {
      train::run_training(c, quiet());
      ADD_FAILURE() << "a diverged run returned normally";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("training diverged; lower --lr"), std::string::npos) << m;
      EXPECT_NE(m.find(steps == 3 ? "the last step was not finite" : "10 non-finite step(s) in a row"),
                std::string::npos)
          << m;
    }
    if (steps == 3) {
      EXPECT_EQ(train::find_checkpoint(out.string()), (out / "step-3").string());
    }
    fs::remove_all(out);
  }
}

TEST(Checkpoint, RoundTripInHuggingFaceLayout) {
  fs::path d = temp_dir("ckpt");
  nn::LlamaConfig c = train::preset("tiny").model_config(259);
  nn::LlamaForCausalLM m(c, 5);
  data::ByteTokenizer tok;
  train::CheckpointData cd;
  cd.model = &m;
  cd.tokenizer = &tok;
  train::save_checkpoint((d / "ck").string(), cd);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(d / "ck" / f)) << f;
  json::Value cfg = train::read_json_file((d / "ck" / "config.json").string());
  EXPECT_EQ(cfg.find("model_type")->as_string(), "llama");
  EXPECT_EQ(cfg.find("num_key_value_heads")->as_int(), c.num_key_value_heads);
  auto tensors = io::load_safetensors((d / "ck" / "model.safetensors").string());
  std::vector<std::string> names;
  for (auto& [n, t] : tensors) names.push_back(n);
  EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.1.self_attn.q_proj.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "lm_head.weight"), names.end());
  auto loaded = train::load_model((d / "ck").string());
  EXPECT_EQ(logits_of(*loaded), logits_of(m));
  EXPECT_EQ(data::load_tokenizer((d / "ck").string())->kind(), "byte");
  fs::remove_all(d);
}

// (From a probe.) An untied model's missing lm_head.weight is an error (it took the embedding's
// values without a word), and a load that fails leaves the model as it was (a missing layer left
// 15 of 30 parameters overwritten).
TEST(Checkpoint, ModelStateLoadsAllOrNothing) {
  nn::LlamaConfig c = train::preset("tiny").model_config(259);
  nn::LlamaForCausalLM src(c, 5), dst(c, 6);
  auto state = train::model_state(src);
  std::erase_if(state, [](const auto& kv) { return kv.first == "lm_head.weight"; });
  const auto before = logits_of(dst);
  try {
    train::load_model_state(dst, state);
    ADD_FAILURE() << "no error for a missing lm_head.weight";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'lm_head.weight' is missing"), std::string::npos) << e.what();
  }
  EXPECT_EQ(logits_of(dst), before);  // nothing was written
  c.num_hidden_layers += 1;
  nn::LlamaForCausalLM deeper(c, 7);
  const auto deeper_before = logits_of(deeper);
  EXPECT_THROW(train::load_model_state(deeper, train::model_state(src)), Error);
  EXPECT_EQ(logits_of(deeper), deeper_before);
  train::load_model_state(dst, train::model_state(src));
  EXPECT_EQ(logits_of(dst), logits_of(src));
}

TEST(Checkpoint, FailedWriteLeavesThePreviousCheckpoint) {
  fs::path d = temp_dir("atomic");
  nn::LlamaConfig c = train::preset("tiny").model_config(259);
  nn::LlamaForCausalLM m1(c, 1), m2(c, 2);
  train::CheckpointData cd;
  cd.model = &m1;
  train::save_checkpoint((d / "step-1").string(), cd);
  train::mark_latest(d.string(), "step-1", 2);
  // crash midway through writing the next checkpoint, and through overwriting this one
  cd.model = &m2;
  int files = 0;
  auto crash = [&](const std::string&) {
    if (++files == 2) throw Error("injected crash");
  };
  EXPECT_THROW(train::save_checkpoint((d / "step-2").string(), cd, crash), Error);
  files = 0;
  EXPECT_THROW(train::save_checkpoint((d / "step-1").string(), cd, crash), Error);
  EXPECT_FALSE(fs::exists(d / "step-2"));
  EXPECT_EQ(train::find_checkpoint(d.string()), (d / "step-1").string());
  auto back = train::load_model((d / "step-1").string());
  EXPECT_EQ(logits_of(*back), logits_of(m1));
  for (const auto& e : fs::directory_iterator(d))
    EXPECT_EQ(e.path().filename().string().rfind(".tmp-", 0), std::string::npos) << "left over " << e.path();
  fs::remove_all(d);
}

TEST(Checkpoint, ShardedHuggingFaceCheckpointLoads) {
  fs::path d = temp_dir("hf");
  nn::LlamaConfig c = train::preset("tiny").model_config(259);
  nn::LlamaForCausalLM m(c, 8);
  auto state = train::model_state(m);
  // split into two shards + index, with bf16 and an HF-style extra rotary buffer
  io::TensorMap s1, s2;
  json::Value wm = json::Value::object();
  for (size_t i = 0; i < state.size(); ++i) {
    (i % 2 ? s1 : s2).emplace_back(state[i].first, state[i].second);
    wm[state[i].first] = i % 2 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  s1.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", ones({8}));
  wm["model.layers.0.self_attn.rotary_emb.inv_freq"] = "model-00001-of-00002.safetensors";
  io::save_safetensors((d / "model-00001-of-00002.safetensors").string(), s1);
  io::save_safetensors((d / "model-00002-of-00002.safetensors").string(), s2);
  json::Value idx = json::Value::object();
  idx["metadata"] = json::Value::object();
  idx["weight_map"] = wm;
  std::ofstream(d / "model.safetensors.index.json") << idx.dump();
  json::Value cfg = c.to_json();
  std::ofstream(d / "config.json") << cfg.dump();
  auto loaded = train::load_model(d.string());
  EXPECT_EQ(logits_of(*loaded), logits_of(m));
  // a wrong shape is named
  io::TensorMap bad = train::model_state(m);
  for (auto& [n, t] : bad)
    if (n == "model.norm.weight") t = ones({3});
  nn::LlamaForCausalLM fresh(c, 1);
  try {
    train::load_model_state(fresh, bad);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.norm.weight"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

TEST(Report, SvgHasCurves) {
  std::string svg = train::loss_curve_svg({{"train loss", {{1, 5.0}, {2, 4.0}, {3, 3.5}}}}, "t");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  EXPECT_NE(svg.find("train loss"), std::string::npos);
}

TEST(Report, ProfileToJson) {
  Generator gen(11);
  Tensor a = randn({7, 5}, gen).requires_grad_(true);
  Tensor b = randn({5, 3}, gen);
  profile::Profiler prof;
  {
    profile::Session on(prof);
    sum(matmul(a, b)).backward();
    profile::count_sync("site");
  }
  json::Value j = json::parse(train::profile_to_json(prof).dump());
  auto es = prof.entries();
  auto ks = profile::by_kernel(es);
  ASSERT_FALSE(es.empty());
  const auto& je = j.find("entries")->as_array();
  const auto& jk = j.find("by_kernel")->as_array();
  ASSERT_EQ(je.size(), es.size());
  ASSERT_EQ(jk.size(), ks.size());
  EXPECT_LT(ks.size(), es.size());  // "gemm" and "backward:.../gemm" fold into one kernel
  for (size_t i = 0; i < es.size(); ++i) {
    EXPECT_EQ(je[i].find("name")->as_string(), es[i].name);
    EXPECT_EQ(je[i].find("count")->as_int(), es[i].count);
    EXPECT_DOUBLE_EQ(je[i].find("total_ms")->as_double(), es[i].total_ms);
    EXPECT_DOUBLE_EQ(je[i].find("mean_us")->as_double(), 1000.0 * es[i].total_ms / static_cast<double>(es[i].count));
    EXPECT_EQ(je[i].find("device_time")->as_bool(), es[i].device_time);
  }
  for (size_t i = 0; i < ks.size(); ++i) {
    EXPECT_EQ(jk[i].find("name")->as_string(), ks[i].name);
    EXPECT_EQ(jk[i].find("count")->as_int(), ks[i].count);
  }
  EXPECT_EQ(j.find("syncs")->find("site")->as_int(), 1);
  EXPECT_EQ(j.find("total_syncs")->as_int(), 1);
}

TEST(Train, Bf16MixedPrecisionLossFallsLikeF32) {
  // bf16 forward/backward on f32 master weights (the CUDA default, here on CPU) follows the
  // f32 run's loss curve closely and the loss falls; the masters stay f32.
  std::vector<double> losses[2];
  for (int i = 0; i < 2; ++i) {
    fs::path out = temp_dir(i ? "bf16" : "f32");
    train::TrainConfig c = tiny_run(out, 25);
    c.eval_every = 0;
    c.dtype = i ? "bf16" : "f32";
    train::TrainSummary s = train::run_training(c, quiet());
    losses[i] = s.losses;
    auto w = io::load_safetensors((fs::path(s.checkpoint) / "model.safetensors").string());
    for (auto& [n, t] : w) EXPECT_EQ(t.dtype(), DType::f32) << n;
    fs::remove_all(out);
  }
  ASSERT_EQ(losses[0].size(), 25u);
  ASSERT_EQ(losses[1].size(), 25u);
  // The loss falls: the mean of the last 5 steps (one batch's loss is noisy: the embedded
  // corpus is the project's own text, and an edit moved a hard batch to step 25, 4.55 after 4.2).
  double last5 = 0;
  for (size_t i = 20; i < 25; ++i) last5 += losses[1][i] / 5;
  EXPECT_LT(last5, losses[1].front() - 1.0);
  for (size_t i = 0; i < 25; ++i) EXPECT_NEAR(losses[1][i], losses[0][i], 0.02 * losses[0][i]) << "step " << i + 1;
}

TEST(Train, ProfileWritesTableAndJson) {
  fs::path out = temp_dir("profile");
  train::TrainConfig c = tiny_run(out, 3);
  c.eval_every = 0;
  c.profile = true;
  train::run_training(c, quiet());
  json::Value p = train::read_json_file((out / "profile.json").string());
  EXPECT_EQ(p.find("steps")->as_int(), 2);  // the first step is the warm-up
  bool gemm = false, backward = false;
  for (const json::Value& e : p.find("by_kernel")->as_array()) {
    gemm = gemm || e.find("name")->as_string() == "gemm";
    EXPECT_GT(e.find("count")->as_int(), 0);
  }
  for (const json::Value& e : p.find("entries")->as_array())
    backward = backward || e.find("name")->as_string().rfind("backward:", 0) == 0;
  EXPECT_TRUE(gemm);
  EXPECT_TRUE(backward);
  EXPECT_EQ(p.find("total_syncs")->as_int(), 0);  // CPU
  fs::remove_all(out);
}

TEST(Train, AttentionMasksFromTheConfig) {
  fs::path out = temp_dir("masks");
  train::TrainConfig bad = tiny_run(out, 2);
  // (another word, "sliding", is a mask_mod expression now, refused when it does not compile:
  // TrainRuntimeMods.BadExpressionsAndCombinationsFailBeforeTraining)
  for (const char* m : {"window:0", "window:", "window:x", ""}) {
    bad.attention_mask = m;
    EXPECT_THROW(bad.validate(), Error) << m;
  }
  bad.attention_mask = "document";  // needs packed documents
  bad.sample = "windows";
  EXPECT_THROW(bad.validate(), Error);
  bad.attention_mask = "causal";
  bad.attention = "fast";
  EXPECT_THROW(bad.validate(), Error);
  for (const char* m : {"window:8", "document", "causal"}) {
    for (const char* backend : {"flex", "reference"}) {
      train::TrainConfig c = tiny_run(out, 2);
      c.attention_mask = m;
      c.attention = backend;
      c.sample = "packed";
      train::TrainSummary s = train::run_training(c, quiet());
      EXPECT_TRUE(std::isfinite(s.final_loss)) << m << " " << backend;
      nn::LlamaConfig saved = nn::LlamaConfig::from_json(
          train::read_json_file((fs::path(s.checkpoint) / "config.json").string()));
      EXPECT_EQ(saved.sliding_window, std::string(m) == "window:8" ? 8 : 0);
      EXPECT_EQ(saved.attention_backend, backend);
      fs::remove_all(out);
    }
  }
}
