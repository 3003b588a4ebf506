// Activation checkpointing (kiln/nn/checkpoint.h, LlamaConfig::checkpoint_activations): the
// gradients of a Llama step are bitwise those of the step that keeps its activations, and the
// allocator's peak is lower.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "kiln/autograd/node.h"
#include "kiln/core/allocator.h"
#include "kiln/autograd/grad_mode.h"  // set_deterministic
#include "kiln/nn/checkpoint.h"
#include "kiln/nn/llama.h"
#include "kiln/ops/ops.h"

namespace kiln {
namespace {

struct StepResult {
  std::vector<std::vector<float>> grads;
  int64_t peak_above_start = 0;
};

StepResult llama_step(const std::string& mode, const std::string& attention, uint64_t seed) {
  nn::LlamaConfig c;
  c.vocab_size = 97;
  c.hidden_size = 48;
  c.intermediate_size = 136;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.attention_backend = attention;
  c.checkpoint_activations = mode;
  nn::LlamaForCausalLM m(c, seed);
  std::mt19937 g(static_cast<uint32_t>(seed));
  std::vector<int64_t> ids(3 * 37), tg(3 * 37);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = g() % 97;
    tg[i] = g() % 97;
  }
  const int64_t start = memory_stats(kCPU).current_bytes;
  reset_peak_memory_stats(kCPU);
  {
    Tensor loss = m.loss_sum(from_vector(ids, {3, 37}), from_vector(tg, {3, 37}), Tensor(), 111.0);
    loss.backward();
  }
  StepResult r;
  r.peak_above_start = memory_stats(kCPU).peak_bytes - start;
  for (auto& [name, p] : m.named_parameters()) r.grads.push_back(p->grad().to_vector<float>());
  return r;
}

TEST(ActivationCheckpoint, GradientsBitwiseEqualAndPeakLower) {
  set_deterministic(true);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const char* attention : {"reference", "flex"}) {
    SCOPED_TRACE(attention);
    const StepResult none = llama_step("none", attention, seed);
    for (const char* mode : {"block", "mlp"}) {
      SCOPED_TRACE(mode);
      const StepResult ck = llama_step(mode, attention, seed);
      ASSERT_EQ(ck.grads.size(), none.grads.size());
      for (size_t i = 0; i < none.grads.size(); ++i) {
        ASSERT_EQ(ck.grads[i].size(), none.grads[i].size());
        EXPECT_EQ(std::memcmp(ck.grads[i].data(), none.grads[i].data(), none.grads[i].size() * 4), 0)
            << "parameter " << i;
      }
      EXPECT_LT(ck.peak_above_start, none.peak_above_start);
    }
  }
  set_deterministic(false);
}

TEST(ActivationCheckpoint, OutsideGradModeOrWithoutGradientsItIsThePlainCall) {
  Tensor w = from_vector(std::vector<float>{1.5f, -2.f, 0.25f}, {3});
  w.requires_grad_(true);
  Tensor x = from_vector(std::vector<float>{0.5f, 3.f, -1.f}, {3});
  auto fn = [w](const Tensor& t) { return mul(tanh(t), w); };
  // x needs no gradient: fn(x) as is, w's gradient flows
  sum(nn::checkpoint(fn, x)).backward();
  const std::vector<float> gw = w.grad().to_vector<float>();
  w.set_grad(Tensor());
  Tensor xr = x.detach();
  xr.requires_grad_(true);
  Tensor y = nn::checkpoint(fn, xr);
  EXPECT_EQ(y.grad_fn()->name(), "checkpoint");
  sum(y).backward();
  EXPECT_EQ(w.grad().to_vector<float>(), gw);
  Tensor xr2 = x.detach();
  xr2.requires_grad_(true);
  sum(fn(xr2)).backward();
  EXPECT_EQ(xr.grad().to_vector<float>(), xr2.grad().to_vector<float>());
}

}  // namespace
}  // namespace kiln
