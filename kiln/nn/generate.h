// Autoregressive sampling from a LlamaForCausalLM with a KV cache: the prompt is run once,
// then one token per step. Temperature (0: greedy), top-k, top-p (nucleus), a seed (the
// counter-based generator, so a seed gives the same text on any machine), and a callback per
// token for streaming. Also what every front end (kiln generate, kiln.generate) does around it:
// the options from their flags, and the prompt's ids from a tokenizer.
#pragma once
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "kiln/data/tokenizer.h"
#include "kiln/nn/llama.h"

namespace kiln::nn {

struct GenerateOptions {
  int64_t max_new_tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 0;    // 0: all
  double top_p = 1.0;   // 1: all
  uint64_t seed = 0;
  int64_t eos_id = -1;  // stop when sampled (-1: never)
  // kiln::Error naming the first option out of range (generate and sample_token call it).
  void validate() const;
};

// The options of a front end's flags, validated (seed too: `who` names the caller in errors).
GenerateOptions generate_options(int64_t max_new_tokens, double temperature, int64_t top_k, double top_p,
                                 int64_t seed, const char* who);

// A prompt as generate takes it: `tok`'s BOS token when it has one, then `text` encoded; and
// `options.eos_id` set to `tok`'s end of sequence.
std::vector<int32_t> encode_prompt(const data::Tokenizer& tok, std::string_view text, GenerateOptions& options);

// How many of a prompt's last tokens generate keeps in a context of `context` positions: all
// that leave room for max_new_tokens, but at least half the context (and at most all of it). An
// 801-token prompt in 256 positions kept 255, so 2 of 5 tokens came back; now 252, and all 5.
int64_t prompt_tokens_kept(int64_t prompt_len, int64_t max_new_tokens, int64_t context);

// Returns the new tokens (not the prompt). `on_token` (optional) sees each as it is sampled.
// The prompt keeps its last prompt_tokens_kept(...) tokens; generation stops early when the
// context is full (fewer than max_new_tokens come back).
std::vector<int32_t> generate(const LlamaForCausalLM& model, const std::vector<int32_t>& prompt,
                              const GenerateOptions& options, const std::function<void(int32_t)>& on_token = nullptr);

// Picks a token from one row of logits (exposed for tests).
int32_t sample_token(const std::vector<float>& logits, const GenerateOptions& options, uint64_t draw);

}  // namespace kiln::nn
