// KV-cache decoding, the token sampler, and the front ends' options and prompt encoding.
#include "kiln/nn/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/rng.h"
#include "kiln/ops/ops.h"

namespace kiln::nn {

void GenerateOptions::validate() const {
  KILN_CHECK(max_new_tokens >= 0, "generate: max_new_tokens=", max_new_tokens, " (--max-tokens) must be >= 0");
  KILN_CHECK(temperature >= 0 && std::isfinite(temperature), "generate: temperature=", temperature,
             " must be a number >= 0");
  KILN_CHECK(top_p > 0 && top_p <= 1, "generate: top_p=", top_p, " (--top-p) must be in (0, 1]");
  KILN_CHECK(top_k >= 0, "generate: top_k=", top_k, " (--top-k) must be >= 0");
}

GenerateOptions generate_options(int64_t max_new_tokens, double temperature, int64_t top_k, double top_p,
                                 int64_t seed, const char* who) {
  KILN_CHECK(seed >= 0, who, ": seed must be >= 0, got ", seed);
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.temperature = temperature;
  o.top_k = top_k;
  o.top_p = top_p;
  o.seed = static_cast<uint64_t>(seed);
  o.validate();
  return o;
}

std::vector<int32_t> encode_prompt(const data::Tokenizer& tok, std::string_view text, GenerateOptions& options) {
  std::vector<int32_t> ids;
  if (tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  for (int32_t t : tok.encode(text)) ids.push_back(t);
  options.eos_id = tok.eos_id();
  return ids;
}

int32_t sample_token(const std::vector<float>& logits, const GenerateOptions& o, uint64_t draw) {
  KILN_CHECK(!logits.empty(), "generate: empty logits");
  o.validate();
  // Non-finite logits have no distribution (as torch.multinomial refuses them): NaN or +inf
  // picked a fixed token, and all -inf the last one.
  bool any_finite = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    KILN_CHECK(!std::isnan(logits[i]) && logits[i] != INFINITY, "generate: logit ", i, " is ", logits[i],
               ": the model's output is not finite");
    any_finite = any_finite || logits[i] != -INFINITY;
  }
  KILN_CHECK(any_finite, "generate: every logit is -inf: no token can be sampled");
  if (o.temperature == 0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  size_t keep = idx.size();
  if (o.top_k > 0) keep = std::min(keep, static_cast<size_t>(o.top_k));
  const double mx = logits[idx[0]];
  std::vector<double> p(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += p[i] = std::exp((logits[idx[i]] - mx) / o.temperature);
  if (o.top_p < 1) {
    double c = 0;
    size_t k = 0;
    while (k < keep) {
      c += p[k++] / total;
      if (c >= o.top_p) break;
    }
    keep = k;
    total = 0;
    for (size_t i = 0; i < keep; ++i) total += p[i];
  }
  Philox4 r = philox_element(o.seed, 0x6E6E, draw);
  double u = uniform53(r.v[0], r.v[1]) * total, c = 0;
  for (size_t i = 0; i < keep; ++i) {
    c += p[i];
    if (u < c) return idx[i];
  }
  return idx[keep - 1];
}

int64_t prompt_tokens_kept(int64_t prompt_len, int64_t max_new_tokens, int64_t context) {
  // P prompt tokens and N new ones feed P + N - 1 positions (the last token is not fed back).
  const int64_t room = context - std::max<int64_t>(max_new_tokens, 1) + 1;
  return std::min(prompt_len, std::max(room, context / 2));
}

std::vector<int32_t> generate(const LlamaForCausalLM& model, const std::vector<int32_t>& prompt_in,
                              const GenerateOptions& o, const std::function<void(int32_t)>& on_token) {
  NoGradGuard ng;
  KILN_CHECK(!prompt_in.empty(), "generate: the prompt has no tokens");
  o.validate();
  const int64_t limit = model.config.max_position_embeddings;
  KILN_CHECK(limit >= 2, "generate: the model's context (max_position_embeddings=", limit,
             ") leaves no position for a new token after the prompt");
  std::vector<int32_t> prompt = prompt_in;
  const int64_t keep = prompt_tokens_kept(static_cast<int64_t>(prompt.size()), o.max_new_tokens, limit);
  prompt.erase(prompt.begin(), prompt.end() - keep);
  const Device dev = model.lm_head_weight().device();
  KVCache cache = model.make_cache();
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  Tensor input = from_vector(ids, {1, static_cast<int64_t>(ids.size())}, dev);
  std::vector<int32_t> out;
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    if (cache.length() + input.size(1) > limit) break;  // context full
    Tensor logits = model.logits(input, Tensor(), &cache);
    Tensor last = logits.select(0, 0).select(0, logits.size(1) - 1).to(DType::f32);
    int32_t tok = sample_token(last.to_vector<float>(), o, static_cast<uint64_t>(step));
    out.push_back(tok);
    if (on_token) on_token(tok);
    if (o.eos_id >= 0 && tok == o.eos_id) break;
    input = from_vector(std::vector<int64_t>{tok}, {1, 1}, dev);
  }
  return out;
}

}  // namespace kiln::nn
