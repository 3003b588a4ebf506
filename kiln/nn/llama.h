// The Llama decoder: configuration (LlamaConfig, read and written as Hugging Face's
// config.json), grouped-query attention with rotary embeddings, the SwiGLU MLP, the decoder
// block and LlamaForCausalLM with optional tied embeddings. Parameter names follow Hugging
// Face ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"), so a checkpoint's
// model.safetensors maps one to one onto named_parameters().
// Attention runs through a backend chosen by a config value: "reference" composes it from
// ops (matmul, dense bool mask, softmax, matmul); "flex" calls kiln::flex_attention with the
// matching BlockMask (causal, sliding window, or causal within documents, one block mask per
// batch row built from the row's document ids). KV-cache decoding always uses the reference path.
// The loss is likewise unfused (linear + cross_entropy) or fused (kiln::linear_cross_entropy).
// logits() and loss_sum() run through the model's forward hooks (Module::call), and each
// decoder block's forward through its own (FSDP's gather and reshard attach there).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/io/json.h"
#include "kiln/nn/module.h"

namespace kiln::attention {
struct RuntimeMods;  // attention/runtime_mods_setup.h
}

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
  // kiln-only, training (not in config.json): "block" or "mlp" recompute a decoder block's (or
  // only its MLP's) activations in the backward instead of keeping them (nn/checkpoint.h).
  std::string checkpoint_activations = "none";
  // kiln-only, training (not in config.json): run-time FlexAttention mods (a score_mod and a
  // mask_mod compiled by the JIT, attention/runtime_mods_setup.h) that replace the causal /
  // sliding-window mask on the flex path; null: none. KV-cache decoding (the reference path)
  // does not apply them.
  std::shared_ptr<const attention::RuntimeMods> runtime_mods;

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

// The masks of one forward pass, built once by LlamaModel and shared by every layer.
struct AttentionMasks {
  Tensor dense;  // reference path: bool [B or 1, 1, T, T_total], true = masked out (undefined: none)
  // flex path (when non-empty): attention::AnyBlockMask handles, one for all rows or one per
  // batch row (document masks)
  std::vector<std::shared_ptr<const void>> flex;
};

class LlamaAttention : public Module {
 public:
  LlamaAttention(const LlamaConfig& c, Generator& gen, Device device);
  // x [B, T, d]; cos/sin [T, D] for the positions of x. With a cache, appends this step's k/v
  // to layer `layer`. masks.flex non-empty: flex_attention; else the reference path with masks.dense.
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, const AttentionMasks& masks, KVCache* cache,
                 int layer) const;
  const LlamaConfig& config;
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
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
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, const AttentionMasks& masks, KVCache* cache,
                 int layer) const;
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMLP> mlp;
  bool checkpoint_mlp = false;  // checkpoint_activations == "mlp"
};

// The decoder body ("model." in Hugging Face names).
class LlamaModel : public Module {
 public:
  LlamaModel(const LlamaConfig& c, Generator& gen, Device device);
  // ids [B, T] → hidden states [B, T, d] after the final norm. doc_ids [B, T] (optional, on any
  // device: host ids avoid a device-to-host copy) masks attention across documents; `cache`
  // enables incremental decoding. config.sliding_window > 0 limits how far back a query sees.
  Tensor forward(const Tensor& ids, const Tensor& doc_ids = Tensor(), KVCache* cache = nullptr) const;
  // The masks forward() uses for a batch of B x T tokens after `past` cached ones.
  AttentionMasks masks(int64_t B, int64_t T, int64_t past, const Tensor& doc_ids, Device device,
                       bool use_flex) const;
  // The rotary cos and sin tables [len, head_dim] on `device`, made once and kept (a longer length
  // or another device, head dim or theta makes them again); forward() narrows them to its positions.
  std::pair<Tensor, Tensor> rotary(int64_t len, Device device) const;
  const LlamaConfig& config;
  std::shared_ptr<Embedding> embed_tokens;
  std::vector<std::shared_ptr<LlamaDecoderLayer>> layers;
  std::shared_ptr<RMSNorm> norm;

 private:
  mutable std::shared_ptr<const void> flex_shared_;  // the last causal/window block mask (reused per shape)
  mutable int64_t flex_shared_len_ = -1;
  mutable Device flex_shared_device_ = kCPU;  // the device it was built for (its block size, its tensors)
  struct RotaryTables {
    Tensor cos, sin;  // [len, head_dim] on device
    int64_t head_dim = 0;
    double theta = 0;
  };
  mutable RotaryTables rotary_;
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

 private:
  Tensor loss_sum_body(const Tensor& ids, const Tensor& targets, const Tensor& doc_ids, double divide_by) const;
};

}  // namespace kiln::nn
