// The Llama decoder: config checks and JSON, attention (reference path), MLP, blocks, loss.
#include "kiln/nn/llama.h"

#include <cmath>
#include <limits>
#include <tuple>

#include "kiln/autograd/grad_mode.h"
#include "kiln/autograd/node.h"
#include "kiln/nn/checkpoint.h"
#include "kiln/ops/fused.h"
#include "kiln/ops/ops.h"

// The fused loss and flex attention are switched on by config values; they are compiled in
// when their headers are part of the tree.
#if __has_include("kiln/loss/linear_cross_entropy.h")
#include "kiln/loss/linear_cross_entropy.h"
#define KILN_NN_HAVE_FUSED_LOSS 1
#endif
#if __has_include("kiln/attention/flex_attention.h")
#include "kiln/attention/flex_attention.h"
#include "kiln/attention/runtime_mods_setup.h"
#define KILN_NN_HAVE_FLEX 1
#endif

namespace kiln::nn {

void LlamaConfig::validate() const {
  auto pos = [](const char* name, int64_t v) {
    KILN_CHECK(v > 0, "config: ", name, "=", v, " must be positive");
  };
  pos("vocab_size", vocab_size);
  pos("hidden_size", hidden_size);
  pos("intermediate_size", intermediate_size);
  pos("num_hidden_layers", num_hidden_layers);
  pos("num_attention_heads", num_attention_heads);
  pos("num_key_value_heads", num_key_value_heads);
  pos("max_position_embeddings", max_position_embeddings);
  KILN_CHECK(hidden_size % num_attention_heads == 0, "config: hidden_size=", hidden_size,
             " is not divisible by num_attention_heads=", num_attention_heads);
  KILN_CHECK(num_attention_heads % num_key_value_heads == 0, "config: num_attention_heads=", num_attention_heads,
             " is not a multiple of num_key_value_heads=", num_key_value_heads);
  KILN_CHECK(head_dim() % 2 == 0, "config: head_dim=hidden_size/num_attention_heads=", head_dim(),
             " must be even for rotary embeddings");
  KILN_CHECK(rms_norm_eps > 0 && std::isfinite(rms_norm_eps), "config: rms_norm_eps=", rms_norm_eps,
             " must be a positive number");
  KILN_CHECK(rope_theta > 0 && std::isfinite(rope_theta), "config: rope_theta=", rope_theta, " must be positive");
  KILN_CHECK(initializer_range >= 0 && std::isfinite(initializer_range), "config: initializer_range=",
             initializer_range, " must be >= 0");
  KILN_CHECK(attention_backend == "reference" || attention_backend == "flex", "config: attention_backend='",
             attention_backend, "' is not one of: reference, flex");
  KILN_CHECK(sliding_window >= 0 && sliding_window < (int64_t{1} << 31), "config: sliding_window=", sliding_window,
             " must be >= 0 (0: off)");
  KILN_CHECK(checkpoint_activations == "none" || checkpoint_activations == "block" || checkpoint_activations == "mlp",
             "config: checkpoint_activations='", checkpoint_activations, "' is not one of: none, block, mlp");
  KILN_CHECK(!runtime_mods || attention_backend == "flex", "config: run-time attention mods need attention_backend=flex, "
             "got '", attention_backend, "'");
}

json::Value LlamaConfig::to_json() const {
  json::Value v = json::Value::object();
  json::Value arch = json::Value::array();
  arch.push_back("LlamaForCausalLM");
  v["architectures"] = std::move(arch);
  v["model_type"] = "llama";
  v["vocab_size"] = vocab_size;
  v["hidden_size"] = hidden_size;
  v["intermediate_size"] = intermediate_size;
  v["num_hidden_layers"] = num_hidden_layers;
  v["num_attention_heads"] = num_attention_heads;
  v["num_key_value_heads"] = num_key_value_heads;
  v["head_dim"] = head_dim();
  v["max_position_embeddings"] = max_position_embeddings;
  v["rms_norm_eps"] = rms_norm_eps;
  v["rope_theta"] = rope_theta;
  v["initializer_range"] = initializer_range;
  v["hidden_act"] = "silu";
  v["attention_bias"] = false;
  v["mlp_bias"] = false;
  v["tie_word_embeddings"] = tie_word_embeddings;
  if (bos_token_id >= 0) v["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) v["eos_token_id"] = eos_token_id;
  v["torch_dtype"] = torch_dtype;
  v["kiln_attention_backend"] = attention_backend;
  v["kiln_fused_loss"] = fused_loss;
  if (sliding_window > 0) v["kiln_sliding_window"] = sliding_window;
  return v;
}

LlamaConfig LlamaConfig::from_json(const json::Value& v) {
  KILN_CHECK(v.is_object(), "config.json: expected a JSON object, got ", v.dump().substr(0, 40));
  LlamaConfig c;
  auto geti = [&](const char* k, int64_t& out) {
    if (const json::Value* x = v.find(k); x && !x->is_null()) out = x->as_int(k);
  };
  auto getd = [&](const char* k, double& out) {
    if (const json::Value* x = v.find(k); x && !x->is_null()) out = x->as_double(k);
  };
  if (const json::Value* mt = v.find("model_type"))
    KILN_CHECK(mt->as_string("model_type") == "llama", "config.json: model_type='", mt->as_string(),
               "' is not supported (expected 'llama')");
  geti("vocab_size", c.vocab_size);
  geti("hidden_size", c.hidden_size);
  geti("intermediate_size", c.intermediate_size);
  geti("num_hidden_layers", c.num_hidden_layers);
  geti("num_attention_heads", c.num_attention_heads);
  c.num_key_value_heads = c.num_attention_heads;
  geti("num_key_value_heads", c.num_key_value_heads);
  geti("max_position_embeddings", c.max_position_embeddings);
  getd("rms_norm_eps", c.rms_norm_eps);
  getd("rope_theta", c.rope_theta);
  getd("initializer_range", c.initializer_range);
  if (const json::Value* x = v.find("tie_word_embeddings")) c.tie_word_embeddings = x->as_bool("tie_word_embeddings");
  if (const json::Value* x = v.find("bos_token_id"); x && x->is_integer()) c.bos_token_id = x->as_int();
  if (const json::Value* x = v.find("eos_token_id"); x && x->is_integer()) c.eos_token_id = x->as_int();
  if (const json::Value* x = v.find("torch_dtype"); x && x->is_string()) c.torch_dtype = x->as_string();
  if (const json::Value* x = v.find("kiln_attention_backend")) c.attention_backend = x->as_string("kiln_attention_backend");
  if (const json::Value* x = v.find("kiln_fused_loss")) c.fused_loss = x->as_bool("kiln_fused_loss");
  geti("kiln_sliding_window", c.sliding_window);
  // Llama variants kiln does not implement: computing them as plain Llama gives wrong logits.
  if (const json::Value* x = v.find("hidden_act"); x && !x->is_null())
    KILN_CHECK(x->is_string() && x->as_string() == "silu", "config.json: hidden_act=", x->dump(),
               " is not supported (kiln's Llama MLP is SwiGLU with silu)");
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (const json::Value* x = v.find(key); x && !x->is_null())
      KILN_CHECK(x->is_bool() && !x->as_bool(), "config.json: ", key, "=", x->dump(),
                 " is not supported (kiln's Llama has no bias terms)");
  if (const json::Value* x = v.find("head_dim"); x && !x->is_null())  // a float (8.0) skipped the check
    KILN_CHECK(x->is_integer() && x->as_int() * c.num_attention_heads == c.hidden_size, "config.json: head_dim=",
               x->dump(), " is not hidden_size/num_attention_heads as an integer (other head dims are not supported)");
  // RoPE parameters: transformers 4.x writes rope_theta (+ rope_scaling, null or a dict);
  // 5.x writes rope_parameters {rope_type, rope_theta}. Only the default rope type is supported.
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const json::Value* x = v.find(key);
    if (!x || x->is_null()) continue;
    KILN_CHECK(x->is_object(), "config.json: ", key, " must be an object or null");
    std::string type = "default";
    if (const json::Value* t = x->find("rope_type"); t && t->is_string()) type = t->as_string();
    else if (const json::Value* t2 = x->find("type"); t2 && t2->is_string()) type = t2->as_string();
    KILN_CHECK(type == "default", "config.json: ", key, " rope_type '", type,
               "' is not supported (kiln implements the default RoPE)");
    if (const json::Value* th = x->find("rope_theta"); th && th->is_number()) c.rope_theta = th->as_double();
  }
  c.validate();
  return c;
}

// ---- attention ----

LlamaAttention::LlamaAttention(const LlamaConfig& c, Generator& gen, Device device) : config(c) {
  const int64_t d = c.hidden_size, D = c.head_dim();
  const double s = c.initializer_range;
  q_proj = register_module("q_proj", std::make_shared<Linear>(d, c.num_attention_heads * D, false, gen, s, device));
  k_proj = register_module("k_proj", std::make_shared<Linear>(d, c.num_key_value_heads * D, false, gen, s, device));
  v_proj = register_module("v_proj", std::make_shared<Linear>(d, c.num_key_value_heads * D, false, gen, s, device));
  o_proj = register_module("o_proj", std::make_shared<Linear>(c.num_attention_heads * D, d, false, gen, s, device));
}

namespace {

// [B, Hkv, T, D] → [B, Hkv*rep, T, D] by repeating each kv head `rep` times (a broadcast view,
// materialised by reshape).
Tensor repeat_kv(const Tensor& x, int64_t rep) {
  if (rep == 1) return x;
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, H, rep, T, D}).reshape({B, H * rep, T, D});
}

// The reference attention: softmax(q kᵀ / sqrt(D) masked) v, built from plain ops.
Tensor reference_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  Tensor scores = mul(matmul(q, k.transpose(-2, -1)), scale);
  if (mask.defined()) scores = masked_fill(scores, mask, -std::numeric_limits<double>::infinity());
  Tensor p = softmax(scores.dtype() == DType::f32 || scores.dtype() == DType::f64 ? scores : scores.to(DType::f32), -1);
  return matmul(p.to(v.dtype()), v);
}

}  // namespace

Tensor LlamaAttention::forward(const Tensor& x, const Tensor& cos, const Tensor& sin, const AttentionMasks& masks,
                               KVCache* cache, int layer) const {
  const int64_t B = x.size(0), T = x.size(1), H = config.num_attention_heads, Hkv = config.num_key_value_heads,
                D = config.head_dim();
  Tensor q = q_proj->forward(x).view({B, T, H, D}).transpose(1, 2);
  Tensor k = k_proj->forward(x).view({B, T, Hkv, D}).transpose(1, 2);
  Tensor v = v_proj->forward(x).view({B, T, Hkv, D}).transpose(1, 2);
  Tensor c = cos.dtype() == x.dtype() ? cos : cos.to(x.dtype());
  Tensor s = sin.dtype() == x.dtype() ? sin : sin.to(x.dtype());
  q = rotary_embedding(q, c, s);
  k = rotary_embedding(k, c, s);
  if (cache) {
    if (cache->k.size() <= static_cast<size_t>(layer)) {
      cache->k.resize(layer + 1);
      cache->v.resize(layer + 1);
    }
    Tensor& ck = cache->k[layer];
    Tensor& cv = cache->v[layer];
    ck = ck.defined() ? cat({ck, k}, 2) : k.contiguous();
    cv = cv.defined() ? cat({cv, v}, 2) : v.contiguous();
    k = ck;
    v = cv;
  }
  Tensor out;
  if (!masks.flex.empty()) {
#ifdef KILN_NN_HAVE_FLEX
    auto mask_of = [&](size_t i) { return *static_cast<const attention::AnyBlockMask*>(masks.flex[i].get()); };
    if (config.runtime_mods) {  // one run-time block mask for every row (LlamaModel::masks)
      out = attention::flex_attention(q, k, v, config.runtime_mods->score_mod,
                                      *static_cast<const attention::RuntimeBlockMask*>(masks.flex[0].get()))
                .out;
    } else if (masks.flex.size() == 1) {
      out = attention::flex_attention(q, k, v, mask_of(0)).out;
    } else {  // one block mask per batch row (documents)
      KILN_CHECK(static_cast<int64_t>(masks.flex.size()) == B, "LlamaAttention: ", masks.flex.size(),
                 " block masks for a batch of ", B);
      // (Each call's recorded backward keeps its mask's document ids alive: BlockLayout::mask_table.)
      std::vector<Tensor> rows;
      for (int64_t b = 0; b < B; ++b)
        rows.push_back(attention::flex_attention(q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1),
                                                 mask_of(static_cast<size_t>(b)))
                           .out);
      out = cat(rows, 0);
    }
#else
    fail("attention_backend=flex: kiln::flex_attention is not part of this build; use attention=reference");
#endif
  } else {  // the reference path (also used for KV-cache decoding)
    out = reference_attention(q, repeat_kv(k, H / Hkv), repeat_kv(v, H / Hkv), masks.dense);
  }
  return o_proj->forward(out.transpose(1, 2).reshape({B, T, H * D}));
}

// ---- MLP, block ----

LlamaMLP::LlamaMLP(const LlamaConfig& c, Generator& gen, Device device) {
  const double s = c.initializer_range;
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(c.hidden_size, c.intermediate_size, false, gen, s, device));
  up_proj = register_module("up_proj", std::make_shared<Linear>(c.hidden_size, c.intermediate_size, false, gen, s, device));
  down_proj = register_module("down_proj", std::make_shared<Linear>(c.intermediate_size, c.hidden_size, false, gen, s, device));
}

Tensor LlamaMLP::forward(const Tensor& x) const {
  // On a GPU the down projection is fused with the product (ops/fused.h): the backward recomputes
  // silu(gate) · up instead of keeping it, the same bits with tokens × intermediate fewer elements
  // held. Not on the CPU, where the small models train: there the recomputed product's fresh
  // allocation cost 7 % of the wall time in page faults (BENCHMARKS.md).
  if (!down_proj->bias.defined() && x.device().is_cuda())
    return swiglu_linear(gate_proj->forward(x), up_proj->forward(x), down_proj->weight);
  return down_proj->forward(swiglu(gate_proj->forward(x), up_proj->forward(x)));
}

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& c, Generator& gen, Device device) {
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(c, gen, device));
  mlp = register_module("mlp", std::make_shared<LlamaMLP>(c, gen, device));
  checkpoint_mlp = c.checkpoint_activations == "mlp";
  input_layernorm = register_module("input_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, device));
  post_attention_layernorm =
      register_module("post_attention_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, device));
}

Tensor LlamaDecoderLayer::forward(const Tensor& x, const Tensor& cos, const Tensor& sin, const AttentionMasks& masks,
                                  KVCache* cache, int layer) const {
  Tensor h = add(x, self_attn->forward(input_layernorm->forward(x), cos, sin, masks, cache, layer));
  if (checkpoint_mlp && !cache)  // --checkpoint-activations mlp: the MLP's activations recomputed
    return add(h, checkpoint([mlp = mlp, norm = post_attention_layernorm](const Tensor& y) {
                 return mlp->forward(norm->forward(y));
               }, h));
  return add(h, mlp->forward(post_attention_layernorm->forward(h)));
}

// ---- model ----

LlamaModel::LlamaModel(const LlamaConfig& c, Generator& gen, Device device) : config(c) {
  embed_tokens = register_module("embed_tokens",
                                 std::make_shared<Embedding>(c.vocab_size, c.hidden_size, gen, c.initializer_range, device));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    layers.push_back(register_module("layers." + std::to_string(i), std::make_shared<LlamaDecoderLayer>(c, gen, device)));
  norm = register_module("norm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, device));
}

namespace {

// Bool mask [B or 1, 1, T, T_total], true where query i (absolute position past + i) must not
// see key j: j > past + i, or past + i - j >= window (window > 0), or (with doc ids, no cache)
// a different document. `d`: the doc ids [B * T] on the host, or empty.
Tensor attention_mask(int64_t B, int64_t T, int64_t past, const std::vector<int64_t>& d, int64_t window,
                      Device device) {
  const int64_t total = past + T;
  auto masked = [&](int64_t i, int64_t j) { return j > past + i || (window > 0 && past + i - j >= window); };
  if (d.empty()) {
    if (T == 1 && (window == 0 || total <= window)) return Tensor();  // one query at the end sees everything
    std::vector<bool> m(static_cast<size_t>(T * total));
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j < total; ++j) m[static_cast<size_t>(i * total + j)] = masked(i, j);
    return from_vector<bool>(m, {1, 1, T, total}, device);
  }
  std::vector<bool> m(static_cast<size_t>(B * T * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j < T; ++j)
        m[static_cast<size_t>((b * T + i) * T + j)] =
            masked(i, j) || d[static_cast<size_t>(b * T + i)] != d[static_cast<size_t>(b * T + j)];
  return from_vector<bool>(m, {B, 1, T, T}, device);
}

}  // namespace

#ifdef KILN_NN_HAVE_FLEX
namespace {
// The flex block masks' block size: 128 (PyTorch's default, what the CUDA kernels tile by) on a
// GPU, 32 on the CPU, whose kernels tile by the block too: at the small preset's causal S = 128 one
// 128-block is a single tile half masked, computed whole, while 32-blocks skip 6 of 16 tiles
// (fwd + bwd 0.64 x the wall time at B=8, H=4, D=32; no slower at S = 1024, BENCHMARKS.md).
int64_t flex_block_size(Device device) { return device.is_cpu() ? 32 : attention::kDefaultBlockSize; }
}  // namespace
#endif

std::pair<Tensor, Tensor> LlamaModel::rotary(int64_t len, Device device) const {
  RotaryTables& r = rotary_;
  if (!r.cos.defined() || r.cos.size(0) < len || r.cos.device() != device || r.head_dim != config.head_dim() ||
      r.theta != config.rope_theta) {
    std::tie(r.cos, r.sin) = rotary_tables(len, config.head_dim(), config.rope_theta, device);
    r.head_dim = config.head_dim();
    r.theta = config.rope_theta;
  }
  return {r.cos.narrow(0, 0, len), r.sin.narrow(0, 0, len)};
}

AttentionMasks LlamaModel::masks(int64_t B, int64_t T, int64_t past, const Tensor& doc_ids, Device device,
                                 bool use_flex) const {
  std::vector<int64_t> d;
  if (doc_ids.defined()) {
    KILN_CHECK(doc_ids.dim() == 2 && doc_ids.size(0) == B && doc_ids.size(1) == T, "LlamaModel: doc_ids has shape ",
               doc_ids.shape(), ", expected [", B, ", ", T, "]");
    // Ids are integers: a float id was truncated (0.5 joined document 0).
    KILN_CHECK(is_integral(doc_ids.dtype()), "LlamaModel: doc_ids must be integers, got ", dtype_name(doc_ids.dtype()));
    d = doc_ids.to(DType::i64).to_vector<int64_t>();
  }
  const int64_t window = config.sliding_window;
  AttentionMasks m;
  if (!use_flex) {
    m.dense = attention_mask(B, T, past, d, window, device);
    return m;
  }
#ifdef KILN_NN_HAVE_FLEX
  KILN_CHECK(past == 0, "LlamaModel: the flex attention path does not decode with a KV cache");
  using attention::AnyBlockMask;
  using attention::MaskSpec;
  if (config.runtime_mods) {  // the run-time mask_mod's block mask, reused while T is the same
    KILN_CHECK(d.empty(), "LlamaModel: run-time attention mods have no document mask (document ids were given)");
    if (!flex_shared_ || flex_shared_len_ != T || flex_shared_device_ != device) {
      flex_shared_ = std::make_shared<const attention::RuntimeBlockMask>(attention::create_block_mask(
          config.runtime_mods->mask_mod, 1, 1, T, T, flex_block_size(device), flex_block_size(device), device));
      flex_shared_len_ = T;
      flex_shared_device_ = device;
    }
    m.flex.push_back(flex_shared_);
    return m;
  }
  if (d.empty()) {  // causal or sliding window: one block mask for every row, reused while T is the same
    if (!flex_shared_ || flex_shared_len_ != T || flex_shared_device_ != device) {
      MaskSpec spec;
      spec.kind = window > 0 ? MaskSpec::Kind::sliding_window : MaskSpec::Kind::causal;
      spec.window = window;
      spec.block_size = flex_block_size(device);
      flex_shared_ = std::make_shared<const AnyBlockMask>(attention::create_block_mask(spec, T, T, device));
      flex_shared_len_ = T;
      flex_shared_device_ = device;
    }
    m.flex.push_back(flex_shared_);
    return m;
  }
  KILN_CHECK(window == 0, "LlamaModel: attention=flex has no sliding window within documents (sliding_window=",
             window, " with document ids); use attention=reference");
  // Documents: a block mask per batch row, classified on the host from the row's ids.
  for (int64_t b = 0; b < B; ++b) {
    // i64 as given: create_block_mask narrows the ids to i32 and refuses ids past its range
    // (a cast here merged documents whose ids differ by a multiple of 2^32).
    const std::vector<int64_t> row(d.begin() + b * T, d.begin() + (b + 1) * T);
    MaskSpec spec;
    spec.kind = MaskSpec::Kind::document;
    spec.document_ids = from_vector(row, {T});
    spec.block_size = flex_block_size(device);
    auto bm = std::make_shared<AnyBlockMask>(attention::create_block_mask(spec, T, T, kCPU));
    if (!device.is_cpu()) {
      bm->layout = bm->layout.to(device);
      bm->spec.document_ids = bm->spec.document_ids.to(device);
    }
    m.flex.push_back(std::move(bm));
  }
  return m;
#else
  fail("attention_backend=flex: kiln::flex_attention is not part of this build; use attention=reference");
#endif
}

Tensor LlamaModel::forward(const Tensor& ids, const Tensor& doc_ids, KVCache* cache) const {
  KILN_CHECK(ids.dim() == 2, "LlamaModel: ids must be [batch, seq], got shape ", ids.shape());
  const int64_t B = ids.size(0), T = ids.size(1);
  const int64_t past = cache ? cache->length() : 0;
  // With any cache, the prefill included: its K/V would be attended across documents by the
  // decode steps after it (the check was past > 0 only).
  KILN_CHECK(!(doc_ids.defined() && cache), "LlamaModel: document ids cannot be combined with a KV cache");
  if (cache && !(cache->k.empty() && cache->v.empty())) {
    // A cache from an earlier call of this model: every layer's K and V [B, Hkv, past, head_dim]
    // (an inconsistent one segfaulted in the attention's concatenation).
    const Shape want{B, config.num_key_value_heads, past, config.head_dim()};
    KILN_CHECK(cache->k.size() == layers.size() && cache->v.size() == layers.size(), "LlamaModel: the KV cache has ",
               cache->k.size(), " K and ", cache->v.size(), " V entries for ", layers.size(), " layers");
    auto desc = [](const Tensor& t) { return t.defined() ? shape_str(t.shape()) : std::string("(none)"); };
    for (size_t i = 0; i < layers.size(); ++i) {
      const Tensor &ck = cache->k[i], &cv = cache->v[i];
      KILN_CHECK(ck.defined() && cv.defined() && ck.shape() == want && cv.shape() == want &&
                     ck.device() == ids.device() && cv.device() == ids.device(),
                 "LlamaModel: KV cache layer ", i, " holds K ", desc(ck), " and V ", desc(cv), ", expected ",
                 shape_str(want), " on ", ids.device().str());
    }
  }
  KILN_CHECK(past + T <= config.max_position_embeddings, "LlamaModel: sequence length ", past + T,
             " exceeds max_position_embeddings=", config.max_position_embeddings);
  auto [cos_all, sin_all] = rotary(past + T, ids.device());
  Tensor cos = cos_all.narrow(0, past, T), sin = sin_all.narrow(0, past, T);
  const AttentionMasks am = masks(B, T, past, doc_ids, ids.device(), config.attention_backend == "flex" && !cache);
  Tensor h = embed_tokens->forward(ids);
  for (size_t i = 0; i < layers.size(); ++i) {
    // Through the block's forward hooks (FSDP gathers its parameters there).
    h = layers[i]->call([&] {
      if (config.checkpoint_activations == "block" && !cache)  // the block's activations recomputed in the backward
        return checkpoint([layer = layers[i], cos, sin, am, i](const Tensor& x) {
                 return layer->forward(x, cos, sin, am, nullptr, static_cast<int>(i));
               }, h);
      return layers[i]->forward(h, cos, sin, am, cache, static_cast<int>(i));
    });
  }
  return norm->forward(h);
}

LlamaForCausalLM::LlamaForCausalLM(const LlamaConfig& c, uint64_t seed, Device device) : config(c) {
  config.validate();
  Generator gen(seed);
  model = register_module("model", std::make_shared<LlamaModel>(config, gen, device));
  if (!config.tie_word_embeddings)
    lm_head = register_module("lm_head", std::make_shared<Linear>(config.hidden_size, config.vocab_size, false, gen,
                                                                  config.initializer_range, device));
}

const Tensor& LlamaForCausalLM::lm_head_weight() const {
  return lm_head ? lm_head->weight : model->embed_tokens->weight;
}

Tensor LlamaForCausalLM::logits(const Tensor& ids, const Tensor& doc_ids, KVCache* cache) const {
  return call([&] { return linear(model->forward(ids, doc_ids, cache), lm_head_weight()); });
}

Tensor LlamaForCausalLM::loss_sum(const Tensor& ids, const Tensor& targets, const Tensor& doc_ids,
                                  double divide_by) const {
  KILN_CHECK(targets.shape() == ids.shape(), "loss: targets shape ", targets.shape(), " differs from ids shape ",
             ids.shape());
  KILN_CHECK(divide_by > 0, "loss: divide_by=", divide_by, " must be positive");
  return call([&] { return loss_sum_body(ids, targets, doc_ids, divide_by); });
}

Tensor LlamaForCausalLM::loss_sum_body(const Tensor& ids, const Tensor& targets, const Tensor& doc_ids,
                                       double divide_by) const {
  Tensor h = model->forward(ids, doc_ids);
  Tensor flat = h.reshape({-1, config.hidden_size});
  Tensor t = targets.reshape({-1});
  if (config.fused_loss) {
#ifdef KILN_NN_HAVE_FUSED_LOSS
    LinearCrossEntropyOptions lo;
    lo.ignore_index = -100;
    lo.reduction = Reduction::sum;
    if (divide_by != 1.0) lo.num_items = divide_by;
    Tensor l = linear_cross_entropy(flat, lm_head_weight(), t, lo).loss;
    return l.dtype() == DType::f32 || l.dtype() == DType::f64 ? l : l.to(DType::f32);
#else
    fail("fused_loss=true: kiln::linear_cross_entropy is not part of this build; use fused_loss=false");
#endif
  }
  CrossEntropyOptions o;
  o.reduction = Reduction::sum;
  Tensor logits = linear(flat, lm_head_weight());
  if (logits.dtype() != DType::f32 && logits.dtype() != DType::f64) logits = logits.to(DType::f32);
  Tensor l = cross_entropy(logits, t, o);
  return divide_by == 1.0 ? l : mul(l, 1.0 / divide_by);
}

KVCache LlamaForCausalLM::make_cache() const { return KVCache{}; }

}  // namespace kiln::nn
