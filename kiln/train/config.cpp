// Presets, the model config, validation and config files for `kiln train` (the field table and
// what it makes: config_fields.cpp; the TOML reader: kiln/io/toml.cpp).
#include "kiln/train/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>

#include "kiln/core/error.h"

namespace kiln::train {

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = {"tiny", "small", "125m", "1b"};
  return names;
}

TrainConfig preset(const std::string& name) {
  TrainConfig c;
  c.preset = name;
  if (name == "tiny") {  // seconds on a laptop: tests and smoke runs
    c.hidden = 64; c.layers = 2; c.heads = 4; c.kv_heads = 2; c.intermediate = 176;
    c.steps = 200; c.batch = 8; c.seq = 64; c.lr = 3e-3; c.eval_every = 50; c.ckpt_every = 0;
  } else if (name == "small") {  // the default: about two minutes on 2 CPU cores
    c.hidden = 128; c.layers = 4; c.heads = 4; c.kv_heads = 2; c.intermediate = 352;
    c.steps = 600; c.batch = 8; c.seq = 128; c.lr = 2e-3; c.eval_every = 100; c.ckpt_every = 0;
  } else if (name == "125m") {  // GPT-3 small shape
    c.hidden = 768; c.layers = 12; c.heads = 12; c.kv_heads = 4; c.intermediate = 2048;
    c.steps = 5000; c.batch = 16; c.seq = 2048; c.lr = 6e-4; c.eval_every = 250; c.ckpt_every = 1000;
    c.device = "cuda"; c.tie_embeddings = true;
  } else if (name == "1b") {  // Llama-3.2-1B shape
    c.hidden = 2048; c.layers = 16; c.heads = 32; c.kv_heads = 8; c.intermediate = 8192;
    c.steps = 10000; c.batch = 8; c.seq = 2048; c.lr = 3e-4; c.eval_every = 500; c.ckpt_every = 1000;
    c.rope_theta = 500000.0; c.device = "cuda"; c.tie_embeddings = true;
  } else {
    std::string all;
    for (const auto& n : preset_names()) all += (all.empty() ? "" : ", ") + n;
    fail("config: preset '", name, "' is not one of: ", all);
  }
  return c;
}

nn::LlamaConfig TrainConfig::model_config(int64_t vocab) const {
  nn::LlamaConfig m;
  m.vocab_size = vocab;
  m.hidden_size = hidden;
  m.intermediate_size = intermediate;
  m.num_hidden_layers = layers;
  m.num_attention_heads = heads;
  m.num_key_value_heads = kv_heads;
  m.max_position_embeddings = std::max<int64_t>(seq, 256);
  m.rms_norm_eps = norm_eps;
  m.rope_theta = rope_theta;
  m.initializer_range = init_std;
  m.tie_word_embeddings = tie_embeddings;
  m.attention_backend = attention_backend(device.rfind("cuda", 0) == 0);
  if (attention_mask.rfind("window:", 0) == 0) m.sliding_window = std::stoll(attention_mask.substr(7));
  m.fused_loss = fused_loss;
  m.checkpoint_activations = checkpoint_activations;
  return m;
}

std::string TrainConfig::attention_backend(bool cuda) const {
  if (attention != "auto") return attention;
  // flex on both: on CPU (small preset, measured, docs/training.md) it is as fast as the
  // reference path on one thread and faster on two; on CUDA it avoids the T x T scores.
  (void)cuda;
  return "flex";
}

bool TrainConfig::document_mask() const {
  return attention_mask == "document" || (attention_mask == "auto" && sample == "packed");
}

bool TrainConfig::mask_is_expression() const {
  return attention_mask != "auto" && attention_mask != "causal" && attention_mask != "document" &&
         attention_mask.rfind("window:", 0) != 0;
}

std::string TrainConfig::mask_expression() const {
  if (mask_is_expression()) return attention_mask;
  if (attention_mask.rfind("window:", 0) == 0) return "q_idx >= kv_idx && q_idx - kv_idx < " + attention_mask.substr(7);
  return "q_idx >= kv_idx";
}

std::string TrainConfig::optimizer_in_backward_unavailable() const {
  if (accum != 1)
    return detail::str_cat("using up each micro-batch's gradient: it needs accum=1 (one micro-batch a step), got accum=",
                           accum);
  if (nproc != 1 || fsdp)
    return detail::str_cat("in one process: it cannot run FSDP-sharded (nproc=", nproc, fsdp ? ", fsdp" : "", ")");
  return "";
}

void TrainConfig::validate() const {
  auto pos = [](const char* k, int64_t v) { KILN_CHECK(v > 0, "config: ", k, "=", v, " must be positive"); };
  pos("steps", steps);
  pos("batch", batch);
  pos("seq", seq);
  pos("accum", accum);
  pos("nproc", nproc);
  KILN_CHECK(on_failure == "restart" || on_failure == "shrink", "config: on_failure='", on_failure,
             "' is not one of: restart, shrink");
  KILN_CHECK(max_restarts >= 0, "config: max_restarts=", max_restarts, " must be >= 0");
  KILN_CHECK(global_batch >= 0, "config: global_batch=", global_batch, " must be >= 0 (0: batch x accum x ranks)");
  pos("log_every", log_every);
  KILN_CHECK(eval_every >= 0, "config: eval_every=", eval_every, " must be >= 0 (0: never)");
  KILN_CHECK(telemetry_every >= 0, "config: telemetry_every=", telemetry_every, " must be >= 0 (0: never)");
  KILN_CHECK(ckpt_every >= 0, "config: ckpt_every=", ckpt_every, " must be >= 0 (0: only at the end)");
  KILN_CHECK(eval_batches > 0, "config: eval_batches=", eval_batches, " must be positive");
  KILN_CHECK(keep_ckpts >= 1, "config: keep_ckpts=", keep_ckpts, " must be at least 1");
  KILN_CHECK(lr > 0 && std::isfinite(lr), "config: lr=", lr, " must be a positive number");
  KILN_CHECK(min_lr_ratio >= 0 && min_lr_ratio <= 1, "config: min_lr_ratio=", min_lr_ratio, " must be in [0, 1]");
  KILN_CHECK(weight_decay >= 0, "config: weight_decay=", weight_decay, " must be >= 0");
  KILN_CHECK(beta1 >= 0 && beta1 < 1, "config: beta1=", beta1, " must be in [0, 1)");
  KILN_CHECK(beta2 >= 0 && beta2 < 1, "config: beta2=", beta2, " must be in [0, 1)");
  KILN_CHECK(eps > 0, "config: eps=", eps, " must be positive");
  KILN_CHECK(clip >= 0, "config: clip=", clip, " must be >= 0 (0: no clipping)");
  KILN_CHECK(warmup >= -1, "config: warmup=", warmup, " must be >= 0 (or -1: 5% of steps)");
  KILN_CHECK(max_time >= 0, "config: max_time=", max_time, " must be >= 0");
  KILN_CHECK(peak_tflops >= 0 && std::isfinite(peak_tflops), "config: peak_tflops=", peak_tflops,
             " must be >= 0 (0: the device's own)");
  KILN_CHECK(sample_tokens >= 0, "config: sample_tokens=", sample_tokens, " must be >= 0");
  KILN_CHECK(val_fraction >= 0 && val_fraction < 0.5, "config: val_fraction=", val_fraction, " must be in [0, 0.5)");
  KILN_CHECK(sample == "windows" || sample == "packed", "config: sample='", sample, "' is not one of: windows, packed");
  KILN_CHECK(dtype == "auto" || dtype == "f32" || dtype == "bf16", "config: dtype='", dtype,
             "' is not one of: auto, f32, bf16");
  KILN_CHECK(device == "cpu" || device.rfind("cuda", 0) == 0, "config: device='", device,
             "' is not one of: cpu, cuda, cuda:N");
  KILN_CHECK(!out.empty(), "config: out must not be empty");
  KILN_CHECK(vocab >= 0 && vocab <= (int64_t{1} << 31), "config: vocab=", vocab,
             " must be in [0, 2^31] (0: the tokenizer's or the token file's)");
  // The run's settings are stored as JSON (config.json, trainer_state.json), which is UTF-8: a
  // prompt or path with other bytes made a run that could never be resumed.
  for (const auto& [key, value] : {std::pair<const char*, const std::string*>{"data", &data}, {"tokenizer", &tokenizer},
                                   {"prompt", &prompt}, {"out", &out}, {"resume", &resume},
                                   {"attention_mask", &attention_mask}, {"score_mod", &score_mod},
                                   {"score_mod_derivative", &score_mod_derivative}, {"captures", &captures}})
    json::check_utf8(*value, std::string("config: ") + key, "kiln stores a run's settings as JSON, which needs UTF-8");
  KILN_CHECK(attention == "auto" || attention == "reference" || attention == "flex", "config: attention='", attention,
             "' is not one of: auto, reference, flex");
  if (optimizer_in_backward) {
    const char* what = "config: optimizer_in_backward updates each parameter in the backward, ";
    KILN_CHECK(clip == 0, what, "before the gradient norm is known: it needs clip=0 (no clipping), got clip=", clip);
    const std::string why = optimizer_in_backward_unavailable();
    KILN_CHECK(why.empty(), what, why);
  }
  KILN_CHECK(cuda_graphs == "auto" || cuda_graphs == "on" || cuda_graphs == "off", "config: cuda_graphs='",
             cuda_graphs, "' is not one of: auto, on, off");
  KILN_CHECK(gemm_backend.empty() || gemm_backend == "auto" || gemm_backend == "cublaslt" || gemm_backend == "kiln",
             "config: gemm_backend='", gemm_backend, "' is not one of: auto, cublaslt, kiln");
  if (attention_mask.rfind("window:", 0) == 0) {
    const std::string w = attention_mask.substr(7);
    KILN_CHECK(!w.empty() && w.size() < 10 && w.find_first_not_of("0123456789") == std::string::npos &&
                   std::stoll(w) >= 1,
               "config: attention_mask='", attention_mask, "': the window must be a positive integer (window:256)");
  } else {
    // anything else is a mask_mod expression, checked when it compiles (at the start of the run)
    KILN_CHECK(!attention_mask.empty(), "config: attention_mask is empty: give auto, causal, window:W, document or a "
               "mask_mod expression");
  }
  if (runtime_mods()) {
    KILN_CHECK(attention_backend(false) == "flex", "config: run-time attention mods (--score-mod, --attention-mask "
               "EXPR) run on the flex backend; attention='", attention, "'");
    KILN_CHECK(!document_mask(), "config: run-time attention mods have no document mask (attention_mask='",
               attention_mask, "', sample='", sample, "'); use --attention-mask causal, window:W or an expression");
  }
  KILN_CHECK(score_mod_derivative.empty() || !score_mod.empty(), "config: score_mod_derivative without a score_mod");
  KILN_CHECK(captures.empty() || runtime_mods(), "config: captures '", captures, "' without a --score-mod or an "
             "--attention-mask expression to read them");
  KILN_CHECK(attention_mask != "document" || sample == "packed", "config: attention_mask=document needs sample=packed "
             "(per-token document ids come from packed documents), got sample='", sample, "'");
  model_config(256).validate();
  KILN_CHECK(seq <= 1 << 20, "config: seq=", seq, " is too large");
  // a step's micro-batches are held at once: beyond 2^40 tokens their ids alone need 16 TiB
  // (and the products overflow long before int64 does)
  KILN_CHECK(batch <= (int64_t{1} << 40) / seq / accum, "config: batch=", batch, " x seq=", seq, " x accum=", accum,
             " is more than 2^40 tokens per step; use a smaller --batch, --seq or --accum");
}

void apply_config_json(TrainConfig& c, const json::Value& obj) {
  for (const auto& [k, v] : obj.as_object("config")) {
    if (v.is_object()) apply_config_json(c, v);
    else set_config_value(c, k, v);
  }
}

void apply_config_file(TrainConfig& c, const std::string& path) {
  KILN_CHECK(!std::filesystem::is_directory(path), "config: '", path, "' is a directory, not a TOML or JSON file");
  std::ifstream f(path);
  KILN_CHECK(f.good(), "config: cannot open '", path, "'");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  bool is_json = path.size() >= 5 && path.substr(path.size() - 5) == ".json";
  json::Value doc;
  if (is_json) {
    try {
      doc = json::parse(text);
    } catch (const Error& e) {
      fail("config: ", path, ": ", e.what());  // the parser knows the byte, not the file
    }
  } else {
    doc = io::parse_toml(text, path);
  }
  apply_config_json(c, doc);
}

}  // namespace kiln::train
