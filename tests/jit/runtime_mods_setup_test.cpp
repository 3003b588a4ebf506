// The run-time mods of a run's settings (kiln/attention/runtime_mods_setup.h, what the trainer's
// --score-mod / --attention-mask / --captures and kiln precompile use): strings and a captures
// file made into mods that run, their kernels precompiled at once, and the errors.
#include <gtest/gtest.h>

#include "kiln/attention/runtime_mods_setup.h"
#include "kiln/core/error.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"
#include "tests/jit/jit_test_util.h"
#include "tests/ops/harness.h"

using namespace kiln;

TEST(RuntimeModsSetup, StringsAndACapturesFileMakeModsThatRunAfterPrecompiling) {
  test::use_shared_jit_cache();
  KILN_TEST_GENERATOR(gen);
  test::TempDir dir;
  const int64_t H = 3, L = 45, E = 8;
  const Tensor slopes = mul(rand({H}, gen), 0.3), unused = rand({5}, gen);
  const std::string file = dir.path + "/caps.safetensors";
  io::save_safetensors(file, {{"slopes", slopes}, {"unused", unused}});
  const attention::RuntimeMods mods = attention::runtime_mods(
      "score + slopes[h] * (kv_idx - q_idx)", "q_idx >= kv_idx && q_idx - kv_idx < 20", file, kCPU, "", "test");
  ASSERT_EQ(mods.score_mod.captures.size(), 1u);  // only the tensors the expression names
  EXPECT_EQ(mods.score_mod.captures[0].first, "slopes");
  EXPECT_TRUE(mods.mask_mod.captures.empty());
  const attention::PrecompileReport r = attention::precompile_runtime_mods(mods, {DType::f32}, kCPU, true);
  EXPECT_EQ(r.kernels, 3u);  // the tile classifier, the forward, the backward
  EXPECT_GE(r.seconds, 0.0);
  // The mods run, and give what the same mods built by hand give.
  Tensor q = randn({1, H, L, E}, gen), k = randn({1, H, L, E}, gen), v = randn({1, H, L, E}, gen);
  const auto got = attention::flex_attention(q, k, v, mods.score_mod,
                                             attention::create_block_mask(mods.mask_mod, 1, 1, L, L, 16, 16));
  const attention::RuntimeScoreMod sm{"score + slopes[h] * (kv_idx - q_idx)", {{"slopes", slopes}}};
  const auto want = attention::flex_attention(
      q, k, v, sm, attention::create_block_mask(attention::RuntimeMaskMod{"q_idx >= kv_idx && q_idx - kv_idx < 20"},
                                                1, 1, L, L, 16, 16));
  EXPECT_TRUE(test::same_bits(got.out, want.out, "out"));
  // Empty strings are the identity score and the keep-all mask.
  const attention::RuntimeMods plain = attention::runtime_mods("", "", "", kCPU);
  EXPECT_EQ(plain.score_mod.expr, "score");
  EXPECT_EQ(plain.mask_mod.expr, "true");
}

TEST(RuntimeModsSetup, ErrorsNameTheCallerTheFileAndTheExpression) {
  test::use_shared_jit_cache();
  try {
    attention::runtime_mods("score + bias[h]", "", "/nonexistent/caps.safetensors", kCPU, "", "train: --captures");
    FAIL() << "a missing captures file was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train: --captures: cannot read the captures file "
                                         "'/nonexistent/caps.safetensors'"),
              std::string::npos)
        << e.what();
  }
  // An expression naming a capture the file lacks fails at precompile, naming the name.
  const attention::RuntimeMods m = attention::runtime_mods("score + bias[h]", "", "", kCPU);
  try {
    attention::precompile_runtime_mods(m, {DType::f32}, kCPU, false);
    FAIL() << "an unknown name compiled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bias"), std::string::npos) << e.what();
  }
}
