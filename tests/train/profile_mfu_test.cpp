// kiln train --profile's phases and the MFU (step_profile.h, mfu.h): the phase of a profiler key,
// FLOPs per token against a count made here from the model's own matrices, known GPU peaks and
// the CPU estimate, and a profiled run whose metrics.jsonl and profile.json carry the phases
// (each a part of the step, together no more than it) and the MFU of the steps' tokens/s.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "kiln/core/allocator.h"
#include "kiln/io/json.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/mfu.h"
#include "kiln/train/step_profile.h"
#include "kiln/train/trainer.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

TEST(StepProfile, PhaseOfAKey) {
  EXPECT_EQ(train::phase_of("forward:loss/gemm"), "forward");
  EXPECT_EQ(train::phase_of("backward:matmul/gemm"), "backward");
  EXPECT_EQ(train::phase_of("optimizer:step/adamw"), "optimizer");
  EXPECT_EQ(train::phase_of("eval:loss/gemm"), "");
  EXPECT_EQ(train::phase_of("data:batch/copy"), "");  // data is the host's wall time, not kernels
  EXPECT_EQ(train::phase_of("gemm"), "");
  EXPECT_EQ(train::phase_of("x/forward:y"), "");  // a label is the key's first part only
}

TEST(Mfu, FlopsPerTokenCountsEveryMatrixAndTheAttention) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 4; ++trial) {
    nn::LlamaConfig c;
    c.vocab_size = 50 + static_cast<int64_t>(rng() % 300);
    c.num_attention_heads = 1 + static_cast<int64_t>(rng() % 4);
    c.num_key_value_heads = c.num_attention_heads % 2 == 0 ? c.num_attention_heads / 2 : c.num_attention_heads;
    c.hidden_size = c.num_attention_heads * 2 * (1 + static_cast<int64_t>(rng() % 8));
    c.intermediate_size = 8 + static_cast<int64_t>(rng() % 40);
    c.num_hidden_layers = 1 + static_cast<int64_t>(rng() % 3);
    c.tie_word_embeddings = trial % 2 == 0;
    nn::LlamaForCausalLM m(c, 7);
    // the count by hand, in float64: every matrix and vector of the model
    const double d = static_cast<double>(c.hidden_size), f = static_cast<double>(c.intermediate_size),
                 kv = static_cast<double>(c.num_key_value_heads * c.head_dim()), V = static_cast<double>(c.vocab_size);
    const double per_layer = d * d * 2 + d * kv * 2 + 3 * d * f + 2 * d;
    const double params = per_layer * static_cast<double>(c.num_hidden_layers) + d + V * d * (c.tie_word_embeddings ? 1 : 2);
    ASSERT_EQ(static_cast<double>(m.num_parameters()), params);
    const int64_t seq = 16 + static_cast<int64_t>(rng() % 100);
    EXPECT_DOUBLE_EQ(train::flops_per_token(c, m.num_parameters(), seq),
                     6 * params + 12.0 * static_cast<double>(c.num_hidden_layers) * d * static_cast<double>(seq));
  }
  // issue 35's Llama 1.5 B at T 2048: 9.8 GFLOP per token, torch.compile's 57.3 k tokens/s ~57 % of 989 TFLOP/s
  nn::LlamaConfig big;
  big.vocab_size = 128256, big.hidden_size = 2048, big.intermediate_size = 8192, big.num_hidden_layers = 16;
  big.num_attention_heads = 32, big.num_key_value_heads = 8;
  const int64_t n = 16 * (2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192 + 2 * 2048) + 2048 + 2 * 128256 * 2048;
  const double fpt = train::flops_per_token(big, n, 2048);
  EXPECT_NEAR(fpt / 1e9, 9.80, 0.01);
  EXPECT_NEAR(train::mfu(fpt, 57.3e3, train::known_gpu_peak_tflops("NVIDIA H200", DType::bf16)), 0.568, 0.001);
}

TEST(Mfu, PeaksOfKnownGpusAndTheCpuEstimate) {
  EXPECT_DOUBLE_EQ(train::known_gpu_peak_tflops("NVIDIA H200", DType::bf16), 989.4);
  EXPECT_DOUBLE_EQ(train::known_gpu_peak_tflops("NVIDIA H100 80GB HBM3", DType::bf16), 989.4);
  EXPECT_DOUBLE_EQ(train::known_gpu_peak_tflops("NVIDIA A100-SXM4-80GB", DType::bf16), 312.0);
  EXPECT_DOUBLE_EQ(train::known_gpu_peak_tflops("NVIDIA H200", DType::f32), 66.9);
  EXPECT_EQ(train::known_gpu_peak_tflops("Some Future GPU", DType::bf16), 0.0);
  EXPECT_DOUBLE_EQ(train::cpuinfo_ghz("processor: 0\ncpu MHz\t\t: 2000.000\nprocessor: 1\ncpu MHz\t\t: 3000.000\n"), 2.5);
  EXPECT_EQ(train::cpuinfo_ghz("processor: 0\n"), 0.0);
  const train::PeakFlops given = train::peak_flops(kCPU, DType::f32, 1.5);
  EXPECT_EQ(given.tflops, 1.5);
  EXPECT_EQ(given.source, "--peak-tflops");
  EXPECT_FALSE(given.estimate);
  const train::PeakFlops cpu = train::peak_flops(kCPU, DType::f32, 0);
  if (cpu.tflops > 0) {  // /proc/cpuinfo says a clock (not under every emulator)
    EXPECT_TRUE(cpu.estimate);
    EXPECT_NE(cpu.source.find("estimate"), std::string::npos) << cpu.source;
    EXPECT_LT(cpu.tflops, 100.0);  // a few cores, not a GPU
  }
  EXPECT_EQ(train::mfu(1e9, 1e3, 0), 0.0);
}

// Every metrics record carries the allocator's peak: it grows after the first step (AdamW's state
// exists from the first update on, beside the next step's activations), which the telemetry at
// step 1 alone had missed (the GPU benchmarks read their peak from it until 2026-12-07).
TEST(Train, MetricsRecordThePeakAfterEveryStep) {
  fs::path out = test::temp_dir("peak_bytes");
  train::TrainConfig c = test::tiny_run(out, 3);
  c.eval_every = 0;
  std::vector<json::Value> records;
  train::TrainHooks h = test::quiet();
  h.on_log = [&](const json::Value& r) { records.push_back(json::parse(r.dump())); };
  reset_peak_memory_stats(kCPU);
  train::run_training(c, h);
  ASSERT_EQ(records.size(), 3u);
  int64_t last = 0;
  for (const json::Value& r : records) {
    SCOPED_TRACE(r.dump());
    const int64_t peak = r.find("peak_memory_bytes")->as_int();
    EXPECT_GE(peak, r.find("memory_bytes")->as_int());
    EXPECT_GE(peak, last);
    last = peak;
  }
  EXPECT_GT(records[1].find("peak_memory_bytes")->as_int(), records[0].find("peak_memory_bytes")->as_int());
  fs::remove_all(out);
}

TEST(Train, ProfiledRunReportsPhasesAndMfu) {
  fs::path out = test::temp_dir("profile_mfu");
  train::TrainConfig c = test::tiny_run(out, 4);
  c.eval_every = 2;  // evaluation is no phase of a step
  c.profile = true;
  c.peak_tflops = 0.5;
  std::vector<json::Value> records;
  train::TrainHooks h = test::quiet();
  h.on_log = [&](const json::Value& r) { records.push_back(json::parse(r.dump())); };
  train::run_training(c, h);
  ASSERT_EQ(records.size(), 4u);
  const double fpt = train::flops_per_token(c.model_config(259), nn::LlamaForCausalLM(c.model_config(259), 1).num_parameters(),
                                            c.seq);
  for (const json::Value& r : records) {
    SCOPED_TRACE(r.dump());
    const json::Value* p = r.find("profile");
    ASSERT_TRUE(p);
    const double step = p->find("step_ms")->as_double();
    double parts = 0;
    for (const char* k : {"forward_ms", "backward_ms", "optimizer_ms", "data_ms", "comm_ms", "other_ms"}) {
      const double v = p->find(k)->as_double();
      EXPECT_GE(v, 0) << k;
      parts += v;
    }
    EXPECT_GT(p->find("forward_ms")->as_double(), 0);
    EXPECT_GT(p->find("backward_ms")->as_double(), 0);
    EXPECT_GT(p->find("optimizer_ms")->as_double(), 0);
    EXPECT_GT(p->find("data_ms")->as_double(), 0);
    EXPECT_EQ(p->find("comm_ms")->as_double(), 0);  // one process
    EXPECT_EQ(p->find("steps")->as_int(), 1);
    EXPECT_NEAR(parts, step, 1e-6 * step + 1e-9);  // other is what the phases leave of the step
    EXPECT_DOUBLE_EQ(r.find("mfu")->as_double(), fpt * r.find("tokens_per_s")->as_double() / 0.5e12);
  }
  json::Value pj = train::read_json_file((out / "profile.json").string());
  const json::Value* ph = pj.find("phases");
  ASSERT_TRUE(ph);
  EXPECT_EQ(ph->find("steps")->as_int(), 3);  // after the warm-up step
  const json::Value* m = pj.find("mfu");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->find("peak_source")->as_string(), "--peak-tflops");
  EXPECT_DOUBLE_EQ(m->find("flops_per_token")->as_double(), fpt);
  const double tps = c.batch * c.seq * c.accum / (ph->find("step_ms")->as_double() / 1e3);
  EXPECT_NEAR(m->find("mfu")->as_double(), fpt * tps / 0.5e12, 1e-9 * fpt * tps / 0.5e12);
  fs::remove_all(out);
  // without --profile: the MFU, no phases
  c.profile = false;
  c.out = (out / "plain").string();
  records.clear();
  train::run_training(c, h);
  ASSERT_FALSE(records.empty());
  EXPECT_FALSE(records.back().contains("profile"));
  EXPECT_TRUE(records.back().contains("mfu"));
  fs::remove_all(out);
}
