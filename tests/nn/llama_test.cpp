// nn tests: module naming, the tiny Llama's forward and backward against a float64 reference
// composed from basic ops (one-hot matmul, explicit RMSNorm/RoPE/softmax attention), the KV
// cache against the full forward, document masks, config checks and the token sampler.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <tuple>

#include "kiln/autograd/grad_mode.h"
#include "kiln/nn/generate.h"
#include "kiln/nn/llama.h"
#include "kiln/ops/ops.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::nn;

namespace {

LlamaConfig tiny_config(bool tied = false) {
  LlamaConfig c;
  c.vocab_size = 13;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  c.initializer_range = 0.3;  // large, so that the test sees non-trivial attention
  return c;
}

Tensor random_ids(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  Generator g(seed);
  Tensor u = rand({B, T}, g, DType::f64);
  std::vector<int64_t> ids;
  for (double x : u.to_vector<double>()) ids.push_back(static_cast<int64_t>(x * static_cast<double>(V)));
  return from_vector(ids, {B, T});
}

Tensor one_hot(const Tensor& ids, int64_t V) {
  std::vector<int64_t> v = ids.to_vector<int64_t>();
  std::vector<double> out(v.size() * static_cast<size_t>(V), 0.0);
  for (size_t i = 0; i < v.size(); ++i) out[i * static_cast<size_t>(V) + static_cast<size_t>(v[i])] = 1.0;
  Shape s = ids.shape();
  s.push_back(V);
  return from_vector(out, s);
}

// Independent float64 reference of LlamaForCausalLM's mean loss, from basic ops only.
struct Reference {
  LlamaConfig c;
  std::map<std::string, Tensor> p;  // f64 leaves

  Tensor rms(const Tensor& x, const Tensor& w) const {
    return x * rsqrt(mean(x * x, {-1}, true) + c.rms_norm_eps) * w;
  }
  Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) const {
    const int64_t D = x.size(-1);
    Tensor rot = cat({neg(x.narrow(-1, D / 2, D / 2)), x.narrow(-1, 0, D / 2)}, -1);
    return x * cos + rot * sin;
  }
  Tensor lin(const Tensor& x, const std::string& w) const { return matmul(x, p.at(w).t()); }

  Tensor loss(const Tensor& ids, const Tensor& targets) const {
    const int64_t B = ids.size(0), T = ids.size(1), H = c.num_attention_heads, Hkv = c.num_key_value_heads,
                  D = c.head_dim(), V = c.vocab_size;
    std::vector<double> cv, sv, mv;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < D; ++i) {
        double f = std::pow(c.rope_theta, -2.0 * static_cast<double>(i % (D / 2)) / static_cast<double>(D));
        cv.push_back(std::cos(static_cast<double>(t) * f));
        sv.push_back(std::sin(static_cast<double>(t) * f));
      }
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j < T; ++j) mv.push_back(j > i ? -1e300 : 0.0);
    Tensor cos = from_vector(cv, {T, D}), sin = from_vector(sv, {T, D}), mask = from_vector(mv, {T, T});
    Tensor h = matmul(one_hot(ids, V), p.at("model.embed_tokens.weight"));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      std::string pre = "model.layers." + std::to_string(l) + ".";
      Tensor x = rms(h, p.at(pre + "input_layernorm.weight"));
      Tensor q = rope(lin(x, pre + "self_attn.q_proj.weight").reshape({B, T, H, D}).transpose(1, 2), cos, sin);
      Tensor k = rope(lin(x, pre + "self_attn.k_proj.weight").reshape({B, T, Hkv, D}).transpose(1, 2), cos, sin);
      Tensor v = lin(x, pre + "self_attn.v_proj.weight").reshape({B, T, Hkv, D}).transpose(1, 2);
      std::vector<Tensor> ks, vs;
      for (int64_t hh = 0; hh < H; ++hh) {
        ks.push_back(k.narrow(1, hh / (H / Hkv), 1));
        vs.push_back(v.narrow(1, hh / (H / Hkv), 1));
      }
      Tensor kr = cat(ks, 1), vr = cat(vs, 1);
      Tensor s = matmul(q, kr.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D))) + mask;
      Tensor e = exp(s - amax(s, {-1}, true));
      Tensor a = matmul(e / sum(e, {-1}, true), vr);
      h = h + lin(a.transpose(1, 2).reshape({B, T, H * D}), pre + "self_attn.o_proj.weight");
      Tensor y = rms(h, p.at(pre + "post_attention_layernorm.weight"));
      Tensor g = lin(y, pre + "mlp.gate_proj.weight");
      h = h + lin(g * sigmoid(g) * lin(y, pre + "mlp.up_proj.weight"), pre + "mlp.down_proj.weight");
    }
    h = rms(h, p.at("model.norm.weight"));
    Tensor logits = matmul(h, (c.tie_word_embeddings ? p.at("model.embed_tokens.weight") : p.at("lm_head.weight")).t());
    Tensor z = logits - amax(logits, {-1}, true);
    Tensor lse = log(sum(exp(z), {-1}, true));
    Tensor nll = -sum((z - lse) * one_hot(targets, V));
    return nll * (1.0 / static_cast<double>(B * T));
  }
};

double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : t.to(DType::f64).to_vector<double>()) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace

TEST(Module, NamedParametersUseHuggingFaceNames) {
  LlamaForCausalLM m(tiny_config(), 1);
  auto named = m.named_parameters();
  std::vector<std::string> names;
  for (auto& [n, t] : named) names.push_back(n);
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");
  EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.1.self_attn.k_proj.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.0.mlp.gate_proj.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.0.post_attention_layernorm.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "model.norm.weight"), names.end());
  EXPECT_EQ(names.size(), 2u + 2u * 9u + 1u);
  for (auto& [n, t] : named) EXPECT_TRUE(t->requires_grad()) << n;
  // k_proj is [Hkv * D, d] for grouped-query attention
  for (auto& [n, t] : named) {
    if (n == "model.layers.0.self_attn.k_proj.weight") {
      EXPECT_EQ(t->shape(), (Shape{8, 16}));
    }
  }
  LlamaForCausalLM tied(tiny_config(true), 1);
  EXPECT_EQ(tied.named_parameters().size(), names.size() - 1);
  EXPECT_EQ(tied.num_parameters(), m.num_parameters() - 13 * 16);
}

// Module::to keeps each parameter's requires_grad and .grad, as PyTorch's (a frozen parameter
// came back trainable, and gradients were dropped).
TEST(Module, ToKeepsFrozenParametersAndGradients) {
  Generator g(3);
  Linear lin(3, 2, true, g);
  lin.bias.requires_grad_(false);
  lin.weight.set_grad(ones({2, 3}));
  lin.to(DType::f64);
  EXPECT_FALSE(lin.bias.requires_grad());
  EXPECT_TRUE(lin.weight.requires_grad());
  ASSERT_TRUE(lin.weight.grad().defined());
  EXPECT_EQ(lin.weight.grad().dtype(), DType::f64);
  EXPECT_EQ(lin.bias.dtype(), DType::f64);
  lin.to(kCPU);  // same device: unchanged
  EXPECT_FALSE(lin.bias.requires_grad());
}

TEST(Module, InitialisationFollowsLlama) {
  LlamaConfig c = tiny_config();
  c.initializer_range = 0.02;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  LlamaForCausalLM m(c, 7);
  for (auto& [n, t] : m.named_parameters()) {
    auto v = t->to_vector<float>();
    if (n.find("norm") != std::string::npos) {
      for (float x : v) ASSERT_EQ(x, 1.0f) << n;
      continue;
    }
    double s = 0, s2 = 0;
    for (float x : v) { s += x; s2 += static_cast<double>(x) * x; }
    double mean = s / static_cast<double>(v.size()), sd = std::sqrt(s2 / static_cast<double>(v.size()) - mean * mean);
    EXPECT_NEAR(sd, 0.02, 0.004) << n;
    EXPECT_NEAR(mean, 0.0, 0.004) << n;
  }
  // the seed decides the weights
  LlamaForCausalLM a(c, 7), b(c, 8);
  EXPECT_EQ(a.lm_head_weight().to_vector<float>(), m.lm_head_weight().to_vector<float>());
  EXPECT_NE(a.lm_head_weight().to_vector<float>(), b.lm_head_weight().to_vector<float>());
}

class LlamaReference : public ::testing::TestWithParam<bool> {};

TEST_P(LlamaReference, ForwardAndBackwardMatchFloat64Reference) {
  const bool tied = GetParam();
  LlamaConfig c = tiny_config(tied);
  LlamaForCausalLM m(c, 42);
  const int64_t B = 2, T = 7;
  Tensor ids = random_ids(B, T, c.vocab_size, 5), targets = random_ids(B, T, c.vocab_size, 6);
  Tensor loss = m.loss_sum(ids, targets) * (1.0 / static_cast<double>(B * T));
  loss.backward();

  Reference ref{c, {}};
  for (auto& [n, t] : m.named_parameters()) ref.p[n] = t->detach().to(DType::f64).requires_grad_(true);
  Tensor rl = ref.loss(ids, targets);
  rl.backward();
  EXPECT_NEAR(loss.item(), rl.item(), 2e-5 * std::abs(rl.item()));
  for (auto& [n, t] : m.named_parameters()) {
    Tensor g = t->grad(), rg = ref.p[n].grad();
    ASSERT_TRUE(g.defined()) << n;
    ASSERT_TRUE(rg.defined()) << n;
    double scale = std::max(max_abs(rg), 1e-6);
    double err = max_abs(sub(g.to(DType::f64), rg));
    EXPECT_LT(err / scale, 2e-4) << n << " max |grad| " << scale;
  }
}
INSTANTIATE_TEST_SUITE_P(Tied, LlamaReference, ::testing::Values(false, true));

TEST(Llama, KVCacheDecodingMatchesFullForward) {
  LlamaConfig c = tiny_config();
  LlamaForCausalLM m(c, 3);
  NoGradGuard ng;
  Tensor ids = random_ids(1, 9, c.vocab_size, 11);
  auto full = m.logits(ids).to_vector<float>();
  KVCache cache;
  Tensor first = m.logits(ids.narrow(1, 0, 5), Tensor(), &cache);
  std::vector<float> inc = first.to_vector<float>();
  for (int64_t t = 5; t < 9; ++t) {
    auto step = m.logits(ids.narrow(1, t, 1), Tensor(), &cache).to_vector<float>();
    inc.insert(inc.end(), step.begin(), step.end());
  }
  EXPECT_EQ(cache.length(), 9);
  ASSERT_EQ(inc.size(), full.size());
  for (size_t i = 0; i < full.size(); ++i) EXPECT_NEAR(inc[i], full[i], 1e-5) << i;
}

// The model keeps its rotary tables between forward passes: made again only for a longer length
// (or another device), each time equal to rotary_tables' rows.
TEST(Llama, RotaryTablesAreKeptAndGrown) {
  LlamaConfig c = tiny_config();
  LlamaForCausalLM m(c, 3);
  const auto rows_equal = [&](const std::pair<Tensor, Tensor>& got, int64_t len) {
    auto [cos, sin] = rotary_tables(len, c.head_dim(), c.rope_theta, kCPU);
    EXPECT_EQ(got.first.shape(), (Shape{len, c.head_dim()}));
    EXPECT_EQ(got.first.to_vector<float>(), cos.to_vector<float>()) << "cos, length " << len;
    EXPECT_EQ(got.second.to_vector<float>(), sin.to_vector<float>()) << "sin, length " << len;
  };
  const auto first = m.model->rotary(4, kCPU);
  rows_equal(first, 4);
  const auto grown = m.model->rotary(10, kCPU);  // longer: made again
  rows_equal(grown, 10);
  const auto kept = m.model->rotary(6, kCPU);  // shorter: the same storage, narrowed
  rows_equal(kept, 6);
  EXPECT_EQ(kept.first.data_ptr(), grown.first.data_ptr());
  EXPECT_EQ(kept.second.data_ptr(), grown.second.data_ptr());
}

TEST(Llama, DocumentMaskIsolatesDocuments) {
  LlamaConfig c = tiny_config();
  LlamaForCausalLM m(c, 4);
  NoGradGuard ng;
  Tensor a = random_ids(1, 8, c.vocab_size, 1);
  std::vector<int64_t> ids = a.to_vector<int64_t>(), ids2 = ids;
  ids2[0] = (ids2[0] + 1) % c.vocab_size;  // change document 0 only
  ids2[2] = (ids2[2] + 3) % c.vocab_size;
  Tensor docs = from_vector(std::vector<int64_t>{0, 0, 0, 1, 1, 1, 1, 1}, {1, 8});
  auto l1 = m.logits(from_vector(ids, {1, 8}), docs).to_vector<float>();
  auto l2 = m.logits(from_vector(ids2, {1, 8}), docs).to_vector<float>();
  const size_t V = static_cast<size_t>(c.vocab_size);
  for (size_t i = 3 * V; i < l1.size(); ++i) EXPECT_EQ(l1[i], l2[i]) << "document 1 saw document 0 at " << i;
  bool differs = false;
  for (size_t i = 0; i < 3 * V; ++i) differs = differs || l1[i] != l2[i];
  EXPECT_TRUE(differs);
  // (From a probe) float ids were truncated (0.5 joined document 0), and a document-masked
  // prefill into a KV cache was allowed (the decode steps after it attend across documents).
  EXPECT_KILN_ERROR(m.logits(from_vector(ids, {1, 8}), docs.to(DType::f32)), "doc_ids must be integers", "f32");
  KVCache cache = m.make_cache();
  EXPECT_KILN_ERROR(m.logits(from_vector(ids, {1, 8}), docs, &cache), "cannot be combined with a KV cache");
}

TEST(Llama, BadConfigValuesGiveClearMessages) {
  auto expect_msg = [](LlamaConfig c, const std::string& text) {
    try {
      c.validate();
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  LlamaConfig c = tiny_config();
  c.num_key_value_heads = 3;
  expect_msg(c, "num_key_value_heads=3");
  c = tiny_config();
  c.hidden_size = 18;
  expect_msg(c, "hidden_size=18");
  c = tiny_config();
  c.rms_norm_eps = -1;
  expect_msg(c, "rms_norm_eps");
  c = tiny_config();
  c.attention_backend = "magic";
  expect_msg(c, "attention_backend='magic'");
  c = tiny_config();
  c.vocab_size = 0;
  expect_msg(c, "vocab_size=0");
  EXPECT_THROW(LlamaForCausalLM(c, 1), Error);
}

TEST(Llama, ConfigJsonRoundTrip) {
  LlamaConfig c = tiny_config(true);
  json::Value v = c.to_json();
  EXPECT_EQ(v.find("model_type")->as_string(), "llama");
  EXPECT_EQ(v.find("architectures")->as_array()[0].as_string(), "LlamaForCausalLM");
  LlamaConfig d = LlamaConfig::from_json(json::parse(v.dump()));
  EXPECT_EQ(d.to_json().dump(), v.dump());
  json::Value bad = json::parse(v.dump());
  bad["model_type"] = "gpt2";
  EXPECT_THROW(LlamaConfig::from_json(bad), Error);
  // transformers 5 puts rope_theta under rope_parameters; scaled RoPE variants are refused
  json::Value v5 = json::parse(v.dump());
  v5["rope_parameters"] = json::parse(R"({"rope_type": "default", "rope_theta": 500000.0})");
  EXPECT_EQ(LlamaConfig::from_json(v5).rope_theta, 500000.0);
  json::Value scaled = json::parse(v.dump());
  scaled["rope_scaling"] = json::parse(R"({"rope_type": "llama3", "factor": 8.0})");
  try {
    LlamaConfig::from_json(scaled);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("llama3"), std::string::npos) << e.what();
  }
  // Llama variants kiln does not compute were taken as plain Llama (wrong logits, no error);
  // Hugging Face's defaults (silu, no biases) load.
  json::Value hf = json::parse(v.dump());
  hf["hidden_act"] = "silu", hf["attention_bias"] = false, hf["mlp_bias"] = false;
  EXPECT_NO_THROW(LlamaConfig::from_json(hf));
  for (const auto& [key, value, needle] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"hidden_act", R"("gelu")", "hidden_act=\"gelu\" is not supported"},
           {"attention_bias", "true", "attention_bias=true is not supported"},
           {"mlp_bias", "true", "mlp_bias=true is not supported"},
           // (from a probe) a float head_dim skipped the check; one that is not hidden / heads fails
           {"head_dim", "8.0", "head_dim=8.0 is not hidden_size/num_attention_heads"},
           {"head_dim", "3", "head_dim=3 is not hidden_size/num_attention_heads"}}) {
    json::Value x = json::parse(v.dump());
    x[key] = json::parse(value);
    try {
      LlamaConfig::from_json(x);
      ADD_FAILURE() << key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(LlamaConfig::from_json(json::parse("[1, 2]")), Error);  // was the default config
}

TEST(Generate, SamplerRespectsTemperatureTopKTopP) {
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.5f, 0.0f};
  GenerateOptions o;
  o.temperature = 0;
  EXPECT_EQ(sample_token(logits, o, 0), 1);
  o.temperature = 1.0;
  o.top_k = 1;
  for (uint64_t d = 0; d < 20; ++d) EXPECT_EQ(sample_token(logits, o, d), 1);
  o.top_k = 2;
  std::map<int, int> seen;
  for (uint64_t d = 0; d < 400; ++d) seen[sample_token(logits, o, d)]++;
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[1], seen[3]);
  o.top_k = 0;
  o.top_p = 0.5;  // p(1) = 0.51 of the softmax: only token 1 remains
  for (uint64_t d = 0; d < 50; ++d) EXPECT_EQ(sample_token(logits, o, d), 1);
  o.top_p = 1.0;
  seen.clear();
  for (uint64_t d = 0; d < 2000; ++d) seen[sample_token(logits, o, d)]++;
  EXPECT_EQ(seen.size(), 5u);
  o.top_p = 0;
  EXPECT_THROW(sample_token(logits, o, 0), Error);
}

TEST(Generate, NonFiniteLogitsAreErrors) {
  // {inf, 1, inf} sampled token 1 every time, {0, nan, 0} token 2, all -inf token 1
  GenerateOptions o;
  o.temperature = 1.0;
  for (const auto& [logits, needle] : std::vector<std::pair<std::vector<float>, std::string>>{
           {{INFINITY, 1, INFINITY}, "logit 0 is inf"}, {{0, NAN, 0}, "logit 1 is nan"},
           {{-INFINITY, -INFINITY}, "every logit is -inf"}}) {
    for (double t : {1.0, 0.0}) {
      o.temperature = t;
      try {
        sample_token(logits, o, 0);
        ADD_FAILURE() << needle;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    }
  }
  o.temperature = 1.0;
  EXPECT_EQ(sample_token({-INFINITY, 0.5f, -INFINITY}, o, 3), 1);  // -inf masks a token
}

TEST(Generate, BadOptionsAreErrorsEvenWithoutSampling) {
  // Checked only when a token was sampled: with max_new_tokens 0 a bad value passed silently
  // (and kiln generate reported it after printing the prompt); an infinite temperature
  // sampled uniformly.
  LlamaForCausalLM m(tiny_config(), 9);
  GenerateOptions o;
  o.max_new_tokens = 0;
  o.temperature = -1;
  EXPECT_THROW(generate(m, {1, 2, 3}, o), Error);
  o.temperature = 0;
  o.top_p = 2;
  EXPECT_THROW(generate(m, {1, 2, 3}, o), Error);
  o.top_p = 1;
  o.temperature = std::numeric_limits<double>::infinity();
  EXPECT_THROW(o.validate(), Error);
  o.temperature = 0.8;
  EXPECT_NO_THROW(o.validate());
}

TEST(Generate, SameSeedSameTokens) {
  LlamaForCausalLM m(tiny_config(), 9);
  GenerateOptions o;
  o.max_new_tokens = 12;
  o.seed = 5;
  auto a = generate(m, {1, 2, 3}, o);
  auto b = generate(m, {1, 2, 3}, o);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 12u);
  o.seed = 6;
  std::vector<int32_t> streamed;
  auto c = generate(m, {1, 2, 3}, o, [&](int32_t t) { streamed.push_back(t); });
  EXPECT_EQ(c, streamed);
}

// The context bounds generation: a prompt longer than it keeps its last max_position − 1 tokens,
// generation stops when the context is full (the last token sampled from a full one), and a context of 1 (no room after any prompt) is an
// error that says so (it was "select: index -1 out of range").
TEST(Generate, TheContextBoundsPromptAndOutput) {
  LlamaConfig c = tiny_config();
  c.max_position_embeddings = 8;
  LlamaForCausalLM m(c, 9);
  GenerateOptions o;
  o.max_new_tokens = 100;
  o.temperature = 0;
  // 3 prompt positions + 5 fed back = 8; the 6th token is sampled from a full context
  EXPECT_EQ(generate(m, {1, 2, 3}, o).size(), 6u);
  // A long prompt keeps what leaves room for the new tokens, but at least half the context: with
  // 100 asked, its last 4 (then 5 come back); with 3 asked, its last 6 and all 3 (it kept its last
  // 7 either way, so 2 came back).
  EXPECT_EQ(prompt_tokens_kept(10, 100, 8), 4);
  EXPECT_EQ(prompt_tokens_kept(10, 3, 8), 6);
  EXPECT_EQ(prompt_tokens_kept(10, 1, 8), 8);
  EXPECT_EQ(prompt_tokens_kept(3, 100, 8), 3);
  EXPECT_EQ(generate(m, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, o).size(), 5u);
  EXPECT_EQ(generate(m, {7, 8, 9, 10}, o), generate(m, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, o));
  o.max_new_tokens = 3;
  EXPECT_EQ(generate(m, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, o), generate(m, {5, 6, 7, 8, 9, 10}, o));
  EXPECT_EQ(generate(m, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, o).size(), 3u);
  o.max_new_tokens = 100;
  c.max_position_embeddings = 1;
  LlamaForCausalLM one(c, 9);
  try {
    generate(one, {1}, o);
    ADD_FAILURE() << "no error for a context of 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_position_embeddings=1) leaves no position for a new token"),
              std::string::npos)
        << e.what();
  }
}

// A KV cache that does not match the model (edited, or from another model) is an error naming
// the layer: a wrong head dim, K without V and different K/V lengths segfaulted.
TEST(Generate, AnInconsistentKvCacheIsAnError) {
  LlamaForCausalLM m(tiny_config(), 9);
  const Tensor ids = from_vector(std::vector<int64_t>{1, 2, 3}, {1, 3});
  KVCache good = m.make_cache();
  m.logits(ids, Tensor(), &good);  // fills every layer
  auto expect_refused = [&](const std::function<void(KVCache&)>& edit, const char* needle) {
    KVCache c = good;
    edit(c);
    try {
      m.logits(ids, Tensor(), &c);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_refused([](KVCache& c) { c.k[0] = zeros({1, 1, 3, 3}); }, "KV cache layer 0 holds K [1, 1, 3, 3]");
  expect_refused([](KVCache& c) { c.v.pop_back(); }, "V entries for");
  expect_refused([](KVCache& c) { c.v[1] = c.v[1].narrow(2, 0, 2); }, "KV cache layer 1 holds");
  KVCache again = good;
  EXPECT_NO_THROW(m.logits(from_vector(std::vector<int64_t>{4}, {1, 1}), Tensor(), &again));
}

TEST(MixedPrecision, Bf16LinearMatchesF32) {
  // bf16 forward copies of f32 weights (kiln train --dtype bf16) need bf16 linear/matmul with
  // transposed operands to agree with f32 (this caught a CPU gemm layout bug).
  Generator g(1);
  Tensor x = randn({2, 5, 8}, g), w = randn({6, 8}, g), up = randn({2, 5, 6}, g);
  Tensor xb = x.to(DType::bf16).detach().requires_grad_(true), wb = w.to(DType::bf16).detach().requires_grad_(true);
  Tensor yb = linear(xb, wb);
  sum(mul(yb.to(DType::f32), up)).backward();
  Tensor xf = x.to(DType::bf16).to(DType::f32).detach().requires_grad_(true);
  Tensor wf = w.to(DType::bf16).to(DType::f32).detach().requires_grad_(true);
  Tensor yf = linear(xf, wf);
  sum(mul(yf, up)).backward();
  auto close = [](const Tensor& a, const Tensor& b) {
    return max_abs(sub(a.to(DType::f64), b.to(DType::f64))) / std::max(max_abs(b), 1e-6);
  };
  EXPECT_LT(close(yb, yf), 1e-2);
  EXPECT_LT(close(xb.grad(), xf.grad()), 1e-2);
  EXPECT_LT(close(wb.grad(), wf.grad()), 1e-2);
}

TEST(Llama, FlexAttentionAndFusedLossMatchTheReferencePath) {
  // The one-switch backends: attention=flex and fused_loss give the reference path's loss and
  // gradients (same weights, same batch), including with gradient-accumulation normalisation.
  LlamaConfig c = tiny_config();
  const int64_t B = 2, T = 9;
  Tensor ids = random_ids(B, T, c.vocab_size, 21), targets = random_ids(B, T, c.vocab_size, 22);
  std::vector<int64_t> tv = targets.to_vector<int64_t>();
  tv[3] = -100;  // an ignored target
  targets = from_vector(tv, {B, T});
  auto run = [&](const std::string& backend, bool fused) {
    LlamaConfig cc = c;
    cc.attention_backend = backend;
    cc.fused_loss = fused;
    auto m = std::make_unique<LlamaForCausalLM>(cc, 42);
    Tensor l = m->loss_sum(ids, targets, Tensor(), 17.0);
    l.backward();
    std::vector<std::vector<float>> grads;
    for (auto& [n, p] : m->named_parameters()) grads.push_back(p->grad().to_vector<float>());
    return std::make_pair(l.item(), grads);
  };
  auto ref = run("reference", false);
  for (auto [backend, fused] : {std::pair<const char*, bool>{"flex", false}, {"reference", true}, {"flex", true}}) {
    auto got = run(backend, fused);
    EXPECT_NEAR(got.first, ref.first, 1e-5 * std::abs(ref.first)) << backend << " fused=" << fused;
    for (size_t i = 0; i < ref.second.size(); ++i) {
      double scale = 1e-6, err = 0;
      for (size_t j = 0; j < ref.second[i].size(); ++j) {
        scale = std::max(scale, static_cast<double>(std::abs(ref.second[i][j])));
        err = std::max(err, static_cast<double>(std::abs(got.second[i][j] - ref.second[i][j])));
      }
      EXPECT_LT(err / scale, 1e-4) << backend << " fused=" << fused << " parameter " << i;
    }
  }
}

namespace {
// Loss and gradients of a tiny Llama (seed 42) for one batch under a backend and masks.
struct LossGrads {
  double loss = 0;
  std::vector<float> logits;
  std::vector<std::vector<float>> grads;
};
LossGrads loss_grads(LlamaConfig c, const std::string& backend, const Tensor& ids, const Tensor& targets,
                     const Tensor& docs) {
  c.attention_backend = backend;
  LlamaForCausalLM m(c, 42);
  LossGrads r;
  {
    NoGradGuard ng;
    r.logits = m.logits(ids, docs).to_vector<float>();
  }
  Tensor l = m.loss_sum(ids, targets, docs, 7.0);
  l.backward();
  r.loss = l.item();
  for (auto& [n, p] : m.named_parameters()) r.grads.push_back(p->grad().to_vector<float>());
  return r;
}
double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
  double scale = 1e-6, err = 0;
  for (size_t j = 0; j < ref.size(); ++j) {
    scale = std::max(scale, static_cast<double>(std::abs(ref[j])));
    err = std::max(err, static_cast<double>(std::abs(got[j] - ref[j])));
  }
  return err / scale;
}
}  // namespace

TEST(Llama, FlexMasksMatchTheReferencePath) {
  // attention=flex with each trainer mask (causal, sliding window, documents with a block mask
  // per batch row) gives the reference path's logits and gradients. T = 150 spans two
  // 128-blocks, so empty, partial and full tiles all occur.
  LlamaConfig c = tiny_config();
  c.max_position_embeddings = 256;
  const int64_t B = 3, T = 150;
  Tensor ids = random_ids(B, T, c.vocab_size, 31), targets = random_ids(B, T, c.vocab_size, 32);
  std::vector<int64_t> dv(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b)  // different document boundaries per row (row 2: one document)
    for (int64_t i = 0; i < T; ++i)
      dv[static_cast<size_t>(b * T + i)] = b == 0 ? (i >= 5) + (i >= 129) : b == 1 ? i / 40 : 7;
  Tensor docs = from_vector(dv, {B, T});
  struct Case {
    const char* name;
    int64_t window;
    Tensor docs;
  };
  for (const Case& k : {Case{"causal", 0, Tensor()}, Case{"window:1", 1, Tensor()}, Case{"window:37", 37, Tensor()},
                        Case{"window:140", 140, Tensor()}, Case{"document", 0, docs}}) {
    LlamaConfig cc = c;
    cc.sliding_window = k.window;
    LossGrads ref = loss_grads(cc, "reference", ids, targets, k.docs);
    LossGrads flex = loss_grads(cc, "flex", ids, targets, k.docs);
    EXPECT_NEAR(flex.loss, ref.loss, 1e-5 * std::abs(ref.loss)) << k.name;
    EXPECT_LT(rel_err(flex.logits, ref.logits), 1e-4) << k.name;
    ASSERT_EQ(flex.grads.size(), ref.grads.size());
    for (size_t i = 0; i < ref.grads.size(); ++i) EXPECT_LT(rel_err(flex.grads[i], ref.grads[i]), 1e-4) << k.name << " " << i;
  }
}

TEST(Llama, FlexDocumentIdsPastInt32AreAnError) {
  // The flex path narrows document ids to i32: 0 and 2^32 would be one document there (and two
  // on the reference path), so ids past i32 are refused with the id named.
  LlamaConfig c = tiny_config();
  c.attention_backend = "flex";
  LlamaForCausalLM m(c, 3);
  const int64_t T = 6;
  const Tensor docs = from_vector(std::vector<int64_t>{0, 0, 0, int64_t{1} << 32, int64_t{1} << 32, int64_t{1} << 32}, {1, T});
  NoGradGuard ng;
  try {
    m.logits(random_ids(1, T, c.vocab_size, 4), docs);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("document id 4294967296 does not fit i32"), std::string::npos) << e.what();
  }
}

TEST(Llama, SlidingWindowLimitsHowFarBackAQuerySees) {
  // Changing token p changes the logits of query q only when 0 <= q - p < window (through
  // one layer; with two layers the reach doubles), on both backends.
  LlamaConfig c = tiny_config();
  c.num_hidden_layers = 1;
  c.sliding_window = 4;
  const int64_t T = 20, p = 6;
  Tensor a = random_ids(1, T, c.vocab_size, 5);
  std::vector<int64_t> ids = a.to_vector<int64_t>(), ids2 = ids;
  ids2[p] = (ids2[p] + 1) % c.vocab_size;
  const size_t V = static_cast<size_t>(c.vocab_size);
  for (const char* backend : {"reference", "flex"}) {
    LlamaConfig cc = c;
    cc.attention_backend = backend;
    LlamaForCausalLM m(cc, 9);
    NoGradGuard ng;
    auto l1 = m.logits(from_vector(ids, {1, T})).to_vector<float>();
    auto l2 = m.logits(from_vector(ids2, {1, T})).to_vector<float>();
    for (int64_t q = 0; q < T; ++q) {
      bool same = true;
      for (size_t v = 0; v < V; ++v) same = same && l1[static_cast<size_t>(q) * V + v] == l2[static_cast<size_t>(q) * V + v];
      EXPECT_EQ(same, !(q >= p && q - p < 4)) << backend << " query " << q;
    }
  }
}
