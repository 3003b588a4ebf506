// TrainConfig: everything `kiln train` needs, built in three layers: a preset (tiny, small,
// 125m, 1b), then a config file (TOML subset or JSON), then command-line flags. Keys are the
// flag names without dashes ("lr", "eval_every"); a TOML [table] or JSON object only groups
// keys ([model] hidden = 256 is the key "hidden"). validate() names every bad value.
//
// NOTE [one field table]: config_fields() is the only list of the settings. Each row names the
// key, the member, the flag, its help and what a resumed run does with it; the setters
// (set_config_value), to_json, changeable_on_resume, the CLI flags of `kiln train` and their
// --help are all made from it, so a new setting is one member and one row.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kiln/io/json.h"
#include "kiln/io/toml.h"
#include "kiln/nn/llama.h"

namespace kiln::train {

struct TrainConfig {
  std::string preset = "small";
  // data
  std::string data;          // file or folder; empty: the embedded default corpus; FILE.bin or random:V: token ids
  int64_t vocab = 0;         // the model's vocabulary; 0: the tokenizer's (text) or the token file's
  std::string tokenizer = "byte";
  std::string sample = "windows";  // windows | packed
  double val_fraction = 0.05;
  // model
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, intermediate = 0;
  double rope_theta = 10000.0, norm_eps = 1e-5, init_std = 0.02;
  bool tie_embeddings = false;
  std::string attention = "auto";  // auto (flex; measured faster or equal on CPU too) | reference | flex
  // auto (document with sample=packed, else causal) | causal | window:W (causal, W tokens back,
  // the query included) | document (causal within the packed documents of the data loader's
  // per-token document ids; needs sample=packed)
  // Any other value is a run-time mask_mod: a C++ expression over b, h, q_idx, kv_idx (docs/jit.md),
  // compiled at the start of the run; it replaces the causal mask (write q_idx >= kv_idx into it).
  std::string attention_mask = "auto";
  // A run-time score_mod: a C++ expression over score, b, h, q_idx, kv_idx ("" none), on the mask
  // above (causal or window:W as expressions; not document). Its derivative: automatic, or given.
  std::string score_mod, score_mod_derivative;
  std::string captures;  // safetensors file of the tensors the expressions name ("" none)
  bool fused_loss = false;
  // CUDA, 16-bit: the backend of the linears' and the fused loss's products (docs/gemm.md):
  // auto | cublaslt | kiln; "" the process's (KILN_GEMM_BACKEND, else cublaslt).
  std::string gemm_backend;
  std::string checkpoint_activations = "none";  // none | block | mlp (recomputed in the backward)
  // CUDA: the step's forward and backward captured once as a CUDA graph and replayed (step_graph.h):
  // auto (where the run allows it, else a note), on (an error where it does not), off.
  std::string cuda_graphs = "auto";
  // optimisation
  int64_t steps = 0, batch = 0, seq = 0, accum = 1, warmup = -1;
  // sequences per optimizer step over every rank and micro-batch (0: batch x accum x ranks);
  // given, it sets the micro-batches per rank: global_batch / (batch x ranks)
  int64_t global_batch = 0;
  int64_t nproc = 1;  // ranks `kiln train` starts on this machine (kiln/dist's launcher; Gloo on CPU)
  // FSDP-sharded at one rank too (--nproc 1 through the launcher and a one-rank world): the
  // sharded path's cost against the one-process trainer. Always so at more than one rank.
  bool fsdp = false;
  // What a job of several ranks does when one dies (docs/training.md, "When a rank dies"):
  // restart (kiln's launcher restarts every rank, up to max_restarts times, each resuming from the
  // run folder's latest checkpoint) or shrink (the survivors go on from the last checkpoint
  // without the lost rank, the global batch unchanged).
  std::string on_failure = "restart";
  int64_t max_restarts = 0;
  double lr = 0, min_lr_ratio = 0.1, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, clip = 1.0;
  // Each parameter updated in the backward as soon as its gradient is complete, the gradient then
  // freed (optim/in_backward.h): needs clip 0, one micro-batch a step and one process.
  bool optimizer_in_backward = false;
  // schedule of side work
  int64_t eval_every = 0, eval_batches = 8, ckpt_every = 0, keep_ckpts = 2, log_every = 1, telemetry_every = 50;
  double max_time = 0;  // seconds; 0 = no limit (stops early, checkpoints)
  int64_t sample_tokens = 200;  // generated at the end (0: none)
  std::string prompt;           // of the final sample
  // run
  std::string out = "runs/kiln";
  std::string device = "cpu";
  std::string dtype = "auto";  // auto (bf16 on CUDA, f32 on CPU) | f32 | bf16
  uint64_t seed = 1234;
  bool deterministic = false;
  bool profile = false;  // op-level profile (also env KILN_PROFILE=1): table at the end, DIR/profile.json
  double peak_tflops = 0;  // the device's peak for MFU (0: known GPUs' data sheet, the CPU's estimate)
  std::string resume;
  bool overwrite = false;  // a fresh run into an `out` holding an earlier run replaces it (else an error)

  // The model config for a tokenizer of `vocab` ids.
  nn::LlamaConfig model_config(int64_t vocab) const;
  // The attention backend for a device: `attention`, or for "auto" flex on CUDA, reference on CPU.
  std::string attention_backend(bool cuda) const;
  // True when the model is given the batch's document ids (attention_mask document, or auto + packed).
  bool document_mask() const;
  // True when attention_mask is a run-time expression (not auto, causal, window:W or document).
  bool mask_is_expression() const;
  // Why this run's settings, its clip aside, rule out optimizer_in_backward ("" when they do not):
  // more than one micro-batch (accum), several ranks or FSDP. validate() refuses them with it;
  // the memory refusal offers the switch only where it is "".
  std::string optimizer_in_backward_unavailable() const;
  // True when the run compiles run-time mods (a mask expression or a score_mod).
  bool runtime_mods() const { return mask_is_expression() || !score_mod.empty(); }
  // The mask_mod expression of a run with runtime_mods(): the expression, or causal / window:W spelt as one.
  std::string mask_expression() const;
  void validate() const;
  json::Value to_json() const;
};

// The names of the presets and a preset's config.
const std::vector<std::string>& preset_names();
TrainConfig preset(const std::string& name);

// What a resumed run does with a setting.
enum class OnResume {
  kept,        // the run's own: taken from its checkpoint (a flag that would change it is an error)
  changeable,  // taken from the new command: the run's length, its intervals, the final sample
  command,     // each invocation's own, not the run's: out, resume, overwrite, profile
};

// One row of the table (NOTE [one field table]).
struct ConfigField {
  using Member = std::variant<std::string TrainConfig::*, int64_t TrainConfig::*, double TrainConfig::*,
                              bool TrainConfig::*, uint64_t TrainConfig::*>;
  std::string key;      // "eval_every"
  std::string flag;     // "--eval-every"; its name without dashes is accepted as a key too ("sample_mode")
  Member member;
  std::string metavar;  // shown in --help ("N"); empty for a boolean switch
  std::string help;
  OnResume on_resume = OnResume::kept;
  bool saved = true;    // recorded with the run (to_json: trainer_state.json's config)
  bool in_file = true;  // settable from a config file or JSON object (resume is not)

  bool is_switch() const { return std::holds_alternative<bool TrainConfig::*>(member); }
  json::Value get(const TrainConfig& c) const;
  // Sets from a JSON value of the member's type (kiln::Error from the JSON accessor otherwise).
  void set(TrainConfig& c, const json::Value& v) const;
  void copy(TrainConfig& to, const TrainConfig& from) const;
};

// Every setting, in the order `kiln train --help` lists them.
const std::vector<ConfigField>& config_fields();
// The row of a key ('-' and '_' alike) or of a flag's name without its dashes; null if none.
const ConfigField* find_config_field(std::string_view key);

// The settings (config keys) a resumed run takes from the new command instead of its checkpoint
// (OnResume::changeable): its length, its eval / checkpoint / log intervals and the final sample.
// Every other saved setting is the run's own (and `out`, OnResume::command, is the command's).
const std::vector<std::string>& changeable_on_resume();

// Sets one key from a JSON value (kiln::Error naming the key for unknown keys or bad types).
void set_config_value(TrainConfig& c, const std::string& key, const json::Value& v);
// Applies every key of a JSON object (nested objects flattened).
void apply_config_json(TrainConfig& c, const json::Value& obj);
// The TOML reader lives in kiln/io/toml.h; named here too for the callers that read train configs.
using io::parse_toml;
// Reads a .toml or .json file and applies it.
void apply_config_file(TrainConfig& c, const std::string& path);

}  // namespace kiln::train
