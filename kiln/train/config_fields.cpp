// The field table of TrainConfig (NOTE [one field table] in config.h) and what is made from it:
// to_json, set_config_value, changeable_on_resume. cli/train.cpp makes the flags from it.
#include <algorithm>

#include "kiln/core/error.h"
#include "kiln/train/config.h"

namespace kiln::train {

namespace {

using C = TrainConfig;

ConfigField row(std::string key, ConfigField::Member m, std::string metavar, std::string help,
                OnResume on_resume = OnResume::kept) {
  ConfigField f;
  f.flag = "--" + key;
  std::replace(f.flag.begin(), f.flag.end(), '_', '-');
  f.key = std::move(key);
  f.member = m;
  f.metavar = std::move(metavar);
  f.help = std::move(help);
  f.on_resume = on_resume;
  return f;
}

std::vector<ConfigField> make_fields() {
  constexpr OnResume changeable = OnResume::changeable, command = OnResume::command;
  std::vector<ConfigField> t = {
      row("preset", &C::preset, "NAME", "model and run preset: tiny, small, 125m, 1b"),
      // data
      row("data", &C::data, "PATH", "text file or folder of text files (default: the built-in corpus); FILE.bin: "
          "token ids (llm.c or nanoGPT files, see kiln tokenize); random:V: uniform ids below V (benchmarks only)"),
      row("vocab", &C::vocab, "N", "the model's vocabulary (0: the tokenizer's, or the token file's sidecar)"),
      row("tokenizer", &C::tokenizer, "SPEC", "'byte' (built in) or a SentencePiece tokenizer.model"),
      row("sample", &C::sample, "MODE", "windows (random windows) or packed (documents, masked)"),
      row("val_fraction", &C::val_fraction, "F", "fraction of the tokens held out for evaluation"),
      // optimisation
      row("steps", &C::steps, "N", "optimizer steps", changeable),
      row("batch", &C::batch, "N", "sequences per micro-batch"),
      row("seq", &C::seq, "N", "tokens per sequence"),
      row("accum", &C::accum, "N", "micro-batches accumulated per step (per rank)"),
      row("global_batch", &C::global_batch, "G", "sequences per optimizer step over all ranks and micro-batches "
          "(0: batch x accum x ranks); sets the micro-batches per rank, G / (batch x ranks), and the data order is "
          "then the same for any number of ranks"),
      row("lr", &C::lr, "LR", "peak learning rate"),
      row("min_lr_ratio", &C::min_lr_ratio, "R", "final lr of the cosine decay, as a fraction of --lr"),
      row("warmup", &C::warmup, "N", "linear warmup steps (-1: 5% of --steps)"),
      row("weight_decay", &C::weight_decay, "W", "AdamW decoupled weight decay (matrices only)"),
      row("beta1", &C::beta1, "B", "AdamW beta1"),
      row("beta2", &C::beta2, "B", "AdamW beta2"),
      row("eps", &C::eps, "E", "AdamW epsilon"),
      row("clip", &C::clip, "NORM", "clip the gradient norm to NORM (0: off)"),
      row("optimizer_in_backward", &C::optimizer_in_backward, "", "update each parameter in the backward as soon "
          "as its gradient is complete and free that gradient (torchtune's optimizer_in_bwd): the gradients are never "
          "all held at once; needs --clip 0, one micro-batch a step and one process, and no step is ever skipped"),
      // model
      row("hidden", &C::hidden, "N", "model width (hidden_size)"),
      row("layers", &C::layers, "N", "decoder layers"),
      row("heads", &C::heads, "N", "attention heads"),
      row("kv_heads", &C::kv_heads, "N", "key/value heads (grouped-query attention)"),
      row("intermediate", &C::intermediate, "N", "SwiGLU MLP width"),
      row("rope_theta", &C::rope_theta, "T", "rotary embedding base"),
      row("norm_eps", &C::norm_eps, "E", "RMSNorm epsilon"),
      row("init_std", &C::init_std, "S", "standard deviation of the initial weights"),
      row("tie_embeddings", &C::tie_embeddings, "", "share the input embedding with the output projection"),
      row("attention", &C::attention, "BACKEND", "attention backend: auto (= flex), reference (ops) or flex"),
      row("attention_mask", &C::attention_mask, "MASK", "auto (document with --sample-mode packed, else causal), "
          "causal, window:W (sliding window of W tokens) or document (causal within packed documents; needs "
          "--sample-mode packed), or a run-time mask_mod: a C++ expression over b, h, q_idx, kv_idx (docs/jit.md; "
          "it replaces the causal mask: 'q_idx >= kv_idx && q_idx - kv_idx < 1024'), compiled before the first step"),
      row("score_mod", &C::score_mod, "EXPR", "a run-time score_mod: a C++ expression over score, b, h, q_idx, kv_idx "
          "(docs/jit.md), e.g. 'score + slopes[h] * (kv_idx - q_idx)', on the causal or window mask or a mask_mod "
          "expression; compiled before the first step"),
      row("score_mod_derivative", &C::score_mod_derivative, "EXPR", "the score_mod's derivative by score (default: "
          "automatic)"),
      row("captures", &C::captures, "FILE", "safetensors file of the tensors the --score-mod / --attention-mask "
          "expressions name (slopes, bias, ...)"),
      row("fused_loss", &C::fused_loss, "", "use the fused linear + cross-entropy loss"),
      row("gemm_backend", &C::gemm_backend, "BACKEND", "CUDA, bf16: the matrix products' backend: cublaslt, kiln "
          "(kiln's Hopper GEMM: the linears, and the fused loss's products with their epilogues) or auto (each "
          "linear's shape measured once, the faster taken); default: KILN_GEMM_BACKEND, else cublaslt", command),
      row("cuda_graphs", &C::cuda_graphs, "WHEN", "CUDA: capture the step's forward and backward once as a CUDA "
          "graph and replay it (one launch instead of thousands): auto (where the run allows it, else a note says "
          "why: docs/training.md), on (an error where a run cannot) or off", command),
      row("checkpoint_activations", &C::checkpoint_activations, "WHAT", "none, block (recompute each decoder "
          "block's activations in the backward) or mlp (only each MLP's): less memory, more compute"),
      // side work
      row("eval_every", &C::eval_every, "N", "evaluate on the held-out split every N steps (0: never)", changeable),
      row("eval_batches", &C::eval_batches, "N", "batches per evaluation"),
      row("ckpt_every", &C::ckpt_every, "N", "checkpoint every N steps (0: only at the end / on Ctrl-C)", changeable),
      row("keep_ckpts", &C::keep_ckpts, "N", "checkpoints kept in --out", changeable),
      row("log_every", &C::log_every, "N", "metrics line every N steps", changeable),
      row("telemetry_every", &C::telemetry_every, "N", "device telemetry in the metrics line every N steps (0: never)"),
      row("max_time", &C::max_time, "SECONDS", "stop (with a checkpoint) after this long (0: no limit)", changeable),
      row("sample_tokens", &C::sample_tokens, "N", "tokens generated at the end (0: none)", changeable),
      row("prompt", &C::prompt, "TEXT", "prompt of the final sample", changeable),
      // run
      row("out", &C::out, "DIR", "run directory: checkpoints, metrics.jsonl, loss.svg (the default moves on to "
          "runs/kiln-2, -3, ... when it holds an earlier run)", command),
      row("overwrite", &C::overwrite, "", "a fresh run into an --out holding an earlier run replaces that run",
          command),
      row("resume", &C::resume, "DIR", "continue from a checkpoint (or a run directory's latest)", command),
      row("nproc", &C::nproc, "N", "train as N ranks on this machine (FSDP-sharded; Gloo on the CPU, NCCL with "
          "one GPU per rank on CUDA), started through kiln launch's launcher; under kiln launch or torchrun kiln "
          "train joins their job instead", command),
      row("fsdp", &C::fsdp, "", "FSDP-sharded even at one rank (--nproc 1: one rank through the launcher, its "
          "parameters gathered and its gradients reduce-scattered over a world of one), to measure the sharded "
          "path against the one-process trainer; always so at --nproc > 1", command),
      row("on_failure", &C::on_failure, "POLICY", "when a rank of --nproc N dies: restart (every rank restarts from "
          "the run folder's latest checkpoint, up to --max-restarts times) or shrink (the survivors reload the last "
          "checkpoint on N-1 ranks and go on, the global batch unchanged)", command),
      row("max_restarts", &C::max_restarts, "K", "restarts of every rank kiln train --nproc allows after a failure "
          "(--on-failure restart; under shrink, when the survivors cannot go on)", command),
      row("device", &C::device, "DEV", "cpu, cuda or cuda:N"),
      row("dtype", &C::dtype, "DT", "auto (bf16 on CUDA, f32 on CPU), f32, or bf16 (f32 master weights)"),
      row("seed", &C::seed, "S", "seed of initialisation and data order"),
      row("deterministic", &C::deterministic, "", "bitwise reproducible kernels (and resumes)"),
      row("profile", &C::profile, "", "op-level profile (also KILN_PROFILE=1): time per kernel call and host syncs, "
          "a table at the end and DIR/profile.json (first step excluded as warm-up), each step's time by phase "
          "(forward, backward, optimizer, data, comm) in metrics.jsonl", command),
      row("peak_tflops", &C::peak_tflops, "T", "the device's peak TFLOP/s for the MFU in metrics.jsonl (0: the data "
          "sheet's for known GPUs, an estimate on the CPU)", command),
  };
  for (ConfigField& f : t) {
    if (f.key == "sample") f.flag = "--sample-mode";
    // Not the run's: never recorded with it (out is, so a run folder names where it was written).
    if (f.key == "overwrite" || f.key == "resume" || f.key == "profile" || f.key == "peak_tflops" || f.key == "nproc" ||
        f.key == "fsdp" || f.key == "on_failure" || f.key == "max_restarts" || f.key == "gemm_backend" ||
        f.key == "cuda_graphs")
      f.saved = false;
    if (f.key == "resume") f.in_file = false;  // a resumed run takes no config file
  }
  return t;
}

}  // namespace

json::Value ConfigField::get(const TrainConfig& c) const {
  return std::visit(
      [&](auto m) -> json::Value {
        using T = std::remove_reference_t<decltype(c.*m)>;
        if constexpr (std::is_same_v<T, uint64_t>) return json::Value(static_cast<int64_t>(c.*m));
        else return json::Value(c.*m);
      },
      member);
}

void ConfigField::set(TrainConfig& c, const json::Value& v) const {
  std::visit(
      [&](auto m) {
        using T = std::remove_reference_t<decltype(c.*m)>;
        if constexpr (std::is_same_v<T, std::string>) c.*m = v.as_string();
        else if constexpr (std::is_same_v<T, int64_t>) c.*m = v.as_int();
        else if constexpr (std::is_same_v<T, double>) c.*m = v.as_double();
        else if constexpr (std::is_same_v<T, bool>) c.*m = v.as_bool();
        else {
          const int64_t x = v.as_int();
          KILN_CHECK(x >= 0, key, " must be >= 0");
          c.*m = static_cast<uint64_t>(x);
        }
      },
      member);
}

void ConfigField::copy(TrainConfig& to, const TrainConfig& from) const {
  std::visit([&](auto m) { to.*m = from.*m; }, member);
}

const std::vector<ConfigField>& config_fields() {
  static const std::vector<ConfigField> fields = make_fields();
  return fields;
}

const ConfigField* find_config_field(std::string_view key_in) {
  std::string key(key_in);
  std::replace(key.begin(), key.end(), '-', '_');
  for (const ConfigField& f : config_fields()) {
    if (f.key == key) return &f;
    std::string flag_key = f.flag.substr(2);
    std::replace(flag_key.begin(), flag_key.end(), '-', '_');
    if (flag_key == key) return &f;
  }
  return nullptr;
}

json::Value TrainConfig::to_json() const {
  json::Value v = json::Value::object();
  for (const ConfigField& f : config_fields())
    if (f.saved) v[f.key] = f.get(*this);
  return v;
}

const std::vector<std::string>& changeable_on_resume() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const ConfigField& f : config_fields())
      if (f.on_resume == OnResume::changeable) k.push_back(f.key);
    return k;
  }();
  return keys;
}

void set_config_value(TrainConfig& c, const std::string& key, const json::Value& v) {
  const ConfigField* f = find_config_field(key);
  KILN_CHECK(f, "config: unknown key '", key, "'");
  KILN_CHECK(f->in_file, "config: key '", key, "' cannot be set in a config file: pass ", f->flag, " ", f->metavar);
  try {
    f->set(c, v);
  } catch (const Error& e) {
    fail("config: key '", key, "' = ", v.dump(), ": ", e.what());  // the value too, as the docs say
  }
}

}  // namespace kiln::train
