// Helpers shared by the trainer tests (tests/train) and the end-to-end runs (tests/e2e):
// a fresh temporary directory, a tiny deterministic training configuration, quiet hooks and
// the logits of a fixed sequence.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <iterator>
#include <vector>

#include "kiln/autograd/grad_mode.h"
#include "kiln/nn/llama.h"
#include "kiln/ops/ops.h"
#include "kiln/train/trainer.h"
#include "tests/expect.h"
#include "tests/temp_dir.h"

namespace kiln::test {

inline std::filesystem::path temp_dir(const std::string& name) { return fresh_temp_dir("train_" + name); }

inline train::TrainConfig tiny_run(const std::filesystem::path& out, int64_t steps) {
  train::TrainConfig c = train::preset("tiny");
  c.hidden = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.intermediate = 64;
  c.layers = 2;
  c.batch = 4;
  c.seq = 32;
  c.steps = steps;
  c.eval_every = 5;
  c.eval_batches = 2;
  c.ckpt_every = 0;
  c.sample_tokens = 0;
  c.out = out.string();
  c.deterministic = true;
  return c;
}

// Hooks that print nothing (and optionally stop when *stop becomes true).
inline train::TrainHooks quiet() {
  train::TrainHooks h;
  h.progress = nullptr;
  return h;
}
inline train::TrainHooks stop_hooks(std::atomic<bool>* stop) {
  train::TrainHooks h = quiet();
  h.stop = stop;
  return h;
}

// The safetensors files of a checkpoint directory (model and optimizer), names and bytes in name
// order: equal strings are bitwise-equal weights and optimizer state.
inline std::string checkpoint_bytes(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string bytes;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    bytes += f.filename().string() + std::string(std::istreambuf_iterator<char>(in), {});
  }
  return bytes;
}

// The logits of a fixed six-token sequence, for comparing models.
inline std::vector<float> logits_of(const nn::LlamaForCausalLM& m) {
  NoGradGuard ng;
  return m.logits(from_vector(std::vector<int64_t>{1, 5, 9, 200, 7, 3}, {1, 6})).to_vector<float>();
}

}  // namespace kiln::test
