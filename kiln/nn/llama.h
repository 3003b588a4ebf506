// The Llama decoder: configuration (LlamaConfig, read and written as Hugging Face's
// config.json), grouped-query attention with rotary embeddings, the SwiGLU MLP, the decoder
// block and LlamaForCausalLM with optional tied embeddings. Parameter names follow Hugging
// Face ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"), so a checkpoint's
// model.safetensors maps one to one onto named_parameters().
// Attention runs through a backend chosen by a config value: "reference" composes it from
// ops (matmul, mask, softmax, matmul); "flex" will call kiln::flex_attention once it lands.
// The loss is likewise unfused (linear + cross_entropy) or fused (kiln::linear_cross_entropy).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/io/json.h"
#include "kiln/nn/module.h"

namespace kiln::nn {

struct LlamaConfig {
  int64_t vocab_size = 259;
  int64_t hidden_size = 128;
  int64_t intermediate_size = 352;
  int64_t num_hidden_layers = 2;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;
  int64_t max_position_embeddings = 256;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1, eos_token_id = -1;  // -1: not written
  std::string torch_dtype = "float32";
  // kiln-only (not part of HF's config): how attention and the loss are computed.
  std::string attention_backend = "reference";  // reference | flex
  bool fused_loss = false;
  // kiln-only: > 0 limits attention to the last `sliding_window` positions (the query included).
  int64_t sliding_window = 0;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // Throws kiln::Error naming the field and value that is wrong.
  void validate() const;
  json::Value to_json() const;  // Hugging Face config.json
  static LlamaConfig from_json(const json::Value& v);
};

// Keys and values of earlier positions, per layer, for decoding one token at a time.
struct KVCache {
  std::vector<Tensor> k, v;  // per layer [B, Hkv, T_past, D]
  int64_t length() const { return k.empty() || !k[0].defined() ? 0 : k[0].size(2); }
};

class LlamaAttention : public Module {
 public:
  LlamaAttention(const LlamaConfig& c, Generator& gen, Device device);
  // x [B, T, d]; cos/sin [T, D] for the positions of x; mask: bool, true = masked out,
  // broadcastable to [B, H, T, T_total]. With a cache, appends this step's k/v to layer `layer`.
  // `plain_causal`: the mask is exactly causal over x (no cache, no documents), which the
  // flex backend computes from a block mask; other cases use the reference path.
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& mask, KVCache* cache,
                 int layer, bool plain_causal = false) const;
  const LlamaConfig& config;
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;

 private:
  mutable std::shared_ptr<void> flex_mask_;  // the flex block mask of the last shape (built once)
  mutable int64_t flex_len_ = -1;
};

class LlamaMLP : public Module {
 public:
  LlamaMLP(const LlamaConfig& c, Generator& gen, Device device);
  Tensor forward(const Tensor& x) const;  // down(silu(gate(x)) * up(x))
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
};

class LlamaDecoderLayer : public Module {
 public:
  LlamaDecoderLayer(const LlamaConfig& c, Generator& gen, Device device);
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& mask, KVCache* cache,
                 int layer, bool plain_causal = false) const;
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMLP> mlp;
};

// The decoder body ("model." in Hugging Face names).
class LlamaModel : public Module {
 public:
  LlamaModel(const LlamaConfig& c, Generator& gen, Device device);
  // ids [B, T] → hidden states [B, T, d] after the final norm. doc_ids [B, T] (optional) masks
  // attention across documents; `cache` enables incremental decoding.
  Tensor forward(const Tensor& ids, const Tensor& doc_ids = Tensor(), KVCache* cache = nullptr) const;
  const LlamaConfig& config;
  std::shared_ptr<Embedding> embed_tokens;
  std::vector<std::shared_ptr<LlamaDecoderLayer>> layers;
  std::shared_ptr<RMSNorm> norm;
};

class LlamaForCausalLM : public Module {
 public:
  // Builds and initialises the model as Llama's reference code does: every Linear and the
  // embedding normal(0, initializer_range), norms ones. Validates the config first.
  LlamaForCausalLM(const LlamaConfig& c, uint64_t seed, Device device = kCPU);
  // The output projection's weight (the embedding's when tied).
  const Tensor& lm_head_weight() const;
  Tensor logits(const Tensor& ids, const Tensor& doc_ids = Tensor(), KVCache* cache = nullptr) const;
  // Sum of the cross-entropy over targets != -100, divided by `divide_by` (the trainer passes
  // the count of non-ignored targets of the whole accumulated batch). Fused
  // (kiln::linear_cross_entropy, num_items = divide_by) or unfused per config.fused_loss.
  Tensor loss_sum(const Tensor& ids, const Tensor& targets, const Tensor& doc_ids = Tensor(),
                  double divide_by = 1.0) const;
  KVCache make_cache() const;

  LlamaConfig config;
  std::shared_ptr<LlamaModel> model;
  std::shared_ptr<Linear> lm_head;  // null when tied
};

}  // namespace kiln::nn
