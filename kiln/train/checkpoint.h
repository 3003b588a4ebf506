// Checkpoints in Hugging Face's layout: a directory with config.json (LlamaConfig),
// model.safetensors (Hugging Face Llama names), the tokenizer's files, and kiln's training
// state (optimizer.safetensors + trainer_state.json). Written atomically: everything goes
// into a temporary sibling directory, each file and the directory are fsynced, then one
// rename puts it in place and `latest` is updated; a crash at any point leaves the previous
// checkpoint whole. load_model() also reads Hugging Face checkpoints (one file or sharded).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kiln/data/tokenizer.h"
#include "kiln/io/json.h"
#include "kiln/nn/llama.h"

namespace kiln::train {

// Called after each file of a checkpoint is written (tests inject failures with it).
using WriteHook = std::function<void(const std::string& file)>;

// Writes a checkpoint directory `dir` atomically: `write` fills a temporary directory, which
// then replaces `dir` (an existing `dir` is removed only after the new one is in place).
void write_dir_atomic(const std::string& dir, const std::function<void(const std::string& tmp)>& write,
                      const WriteHook& hook = nullptr);

struct CheckpointData {
  const nn::LlamaForCausalLM* model = nullptr;
  const data::Tokenizer* tokenizer = nullptr;
  // kiln's training state (absent: a model-only checkpoint)
  std::vector<std::pair<std::string, Tensor>> optimizer_tensors;
  json::Value trainer_state;  // null: not written
  // Written to config.json as kTrainedSeqKey when > 0 (else trainer_state's config.seq, if any).
  int64_t trained_seq_len = 0;
};
void save_checkpoint(const std::string& dir, const CheckpointData& data, const WriteHook& hook = nullptr);

// The model's tensors under Hugging Face names, as f32 CPU tensors (tied: no lm_head.weight).
std::vector<std::pair<std::string, Tensor>> model_state(const nn::LlamaForCausalLM& model);
// Copies tensors into the model's parameters (names as model_state; extra rotary buffers are
// ignored; a missing lm_head.weight is an error unless embeddings are tied).
void load_model_state(nn::LlamaForCausalLM& model, const std::vector<std::pair<std::string, Tensor>>& tensors);

// Reads config.json and the weights (model.safetensors, or model.safetensors.index.json shards).
std::unique_ptr<nn::LlamaForCausalLM> load_model(const std::string& dir, Device device = kCPU);
// The model dir/config.json describes, its weights not loaded (seed 0's initialization).
std::unique_ptr<nn::LlamaForCausalLM> model_from_config(const std::string& dir, Device device = kCPU);
// The key of config.json that records the sequence length a kiln checkpoint was trained at.
constexpr const char* kTrainedSeqKey = "kiln_trained_seq_len";
// That length (kiln eval's default --seq, generate's note); 0 when the checkpoint does not say.
int64_t trained_seq_len(const std::string& dir);
// The tokenizer to use with a checkpoint's model: `spec` when given, else the one saved in
// `dir` (kiln::Error, naming `op`, when it has more ids than the model's vocabulary).
std::unique_ptr<data::Tokenizer> load_tokenizer_for(const nn::LlamaForCausalLM& model, const std::string& dir,
                                                    const std::string& spec, const char* op);
// The weights of a checkpoint directory as named tensors.
std::vector<std::pair<std::string, Tensor>> load_weights(const std::string& dir);

// The newest checkpoint under a run directory (its `latest` file), or `dir` itself when it
// is a checkpoint; "" when there is none. When `latest` is damaged (empty, cut short, naming no
// checkpoint) the newest whole step-N checkpoint, with `note` (when given) saying so.
std::string find_checkpoint(const std::string& dir, std::string* note = nullptr);
// Why find_checkpoint(dir) found none, for an error message: " (no such folder)", " (its 'latest'
// file is empty; checkpoints there: step-2, step-4)", ...; "" when there is nothing to add.
std::string why_no_checkpoint(const std::string& dir);
// Updates `run_dir/latest` (atomically) to name checkpoint `name`, and deletes the oldest
// step-* checkpoints beyond `keep`.
void mark_latest(const std::string& run_dir, const std::string& name, int64_t keep);
// What of an earlier run `run_dir` holds (none: no `latest`, no step-* checkpoint, no non-empty
// metrics.jsonl). A fresh run there would rewrite its metrics and prune its checkpoints among
// the new ones.
struct EarlierRun {
  std::string what;             // "checkpoint step-N" or "metrics.jsonl"; empty: none
  bool has_checkpoint = false;  // so that it can be resumed
  bool exists() const { return !what.empty(); }
};
EarlierRun earlier_run(const std::string& run_dir);
// Removes an earlier run's files from `run_dir` (checkpoints, latest, metrics.jsonl, loss.svg,
// profile.json); anything else there (a token cache, the user's files, a step-notes/ folder that
// holds no checkpoint) stays. A checkpoint is a step-N folder holding a checkpoint's files.
void remove_earlier_run(const std::string& run_dir);

json::Value read_json_file(const std::string& path);
// Reads a checkpoint's trainer_state.json for a resume: kiln::Error when it is absent (a
// model-only checkpoint) or lacks a key kiln writes (e.g. another trainer's file of that name).
json::Value read_trainer_state(const std::string& ckpt_dir);
void write_text_file_synced(const std::string& path, const std::string& text);

}  // namespace kiln::train
