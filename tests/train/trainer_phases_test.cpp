// The Trainer's phases used one by one (trainer.h): steps driven by hand give the bits of
// run_training, eval reads the held-out loss without changing the model, a checkpoint between
// steps resumes bitwise, and in bf16 the module holds only its f32 masters between forwards
// (ParamCast, precision.h), with each forward's casts its own.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "kiln/train/precision.h"
#include "kiln/train/trainer.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

std::vector<uint32_t> bits_of(const std::vector<double>& v) {
  std::vector<uint32_t> b;
  for (double x : v) {
    const float f = static_cast<float>(x);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    b.push_back(u);
  }
  return b;
}

}  // namespace

TEST(TrainerPhases, StepsByHandMatchTheRunAndACheckpointResumesBitwise) {
  const uint64_t seed = std::random_device{}() % 100000;
  for (const char* dtype : {"f32", "bf16"}) {
    SCOPED_TRACE(dtype);
    fs::path out = test::temp_dir(std::string("phases_") + dtype);
    train::TrainConfig c = test::tiny_run(out / "whole", 6);
    c.seed = seed;
    c.dtype = dtype;
    c.accum = 2;
    c.batch = 2;
    const train::TrainSummary whole = train::run_training(c, test::quiet());
    ASSERT_EQ(whole.losses.size(), 6u);

    c.out = (out / "by_hand").string();
    std::vector<double> losses;
    {
      train::Trainer t(c, test::quiet());
      EXPECT_EQ(t.current_step(), 0);
      for (int i = 0; i < 3; ++i) {
        const train::StepResult r = t.step();
        EXPECT_EQ(r.step, i + 1);
        EXPECT_EQ(r.tokens, c.batch * c.seq * c.accum);
        EXPECT_FALSE(r.skipped);
        EXPECT_GT(r.lr, 0);
        EXPECT_TRUE(std::isfinite(r.grad_norm));
        losses.push_back(r.loss);
        // between forwards the model holds its f32 masters only, as leaves
        for (auto& [name, p] : t.model().named_parameters()) {
          ASSERT_EQ(p->dtype(), DType::f32) << name;
          ASSERT_TRUE(p->requires_grad()) << name;
        }
      }
      // eval changes neither the parameters nor the training data order
      const std::vector<float> before = test::logits_of(t.model());
      const double e1 = t.eval(), e2 = t.eval();
      EXPECT_GT(e1, 0);
      EXPECT_EQ(e1, e2);  // the same held-out batches each time
      EXPECT_EQ(test::logits_of(t.model()), before);
      t.checkpoint("by hand");
      EXPECT_TRUE(fs::exists(out / "by_hand" / "step-3" / "model.safetensors"));
    }
    // the rest of the run, resumed from the checkpoint of the hand-driven trainer
    train::TrainConfig r = c;
    r.resume = (out / "by_hand").string();
    const train::TrainSummary rest = train::run_training(r, test::quiet());
    EXPECT_EQ(rest.start_step, 3);
    for (double l : rest.losses) losses.push_back(l);
    EXPECT_EQ(bits_of(losses), bits_of(whole.losses));
    fs::remove_all(out);
  }
}

TEST(TrainerPhases, ParamCastGivesEachForwardItsOwnCasts) {
  fs::path out = test::temp_dir("paramcast");
  train::TrainConfig c = test::tiny_run(out, 1);
  nn::LlamaForCausalLM m(c.model_config(259), std::random_device{}() % 1000, kCPU);
  train::ParamCast cast(m, DType::bf16);
  ASSERT_TRUE(cast.enabled());
  std::vector<Tensor> masters;
  for (auto& [n, p] : m.named_parameters()) masters.push_back(*p);
  const Tensor ids = from_vector(std::vector<int64_t>{1, 5, 9, 200, 7, 3}, {1, 6});
  const Tensor tgt = from_vector(std::vector<int64_t>{5, 9, 200, 7, 3, 1}, {1, 6});
  for (int micro = 0; micro < 2; ++micro) {  // two micro-batches: the second backward must not fail
    train::ParamCast::Forward f(cast);
    for (auto& [n, p] : m.named_parameters()) ASSERT_EQ(p->dtype(), DType::bf16) << n;
    m.loss_sum(ids, tgt).backward();
  }
  size_t i = 0;
  for (auto& [n, p] : m.named_parameters()) {
    EXPECT_EQ(p->dtype(), DType::f32) << n;
    EXPECT_EQ(p->data_ptr(), masters[i++].data_ptr()) << n;  // the master itself, not a copy
    ASSERT_TRUE(p->grad().defined()) << n;
    EXPECT_EQ(p->grad().dtype(), DType::f32) << n;
  }
  train::ParamCast off(m, DType::f32);
  EXPECT_FALSE(off.enabled());
  {
    train::ParamCast::Forward f(off);
    for (auto& [n, p] : m.named_parameters()) EXPECT_EQ(p->dtype(), DType::f32) << n;
  }
  fs::remove_all(out);
}
