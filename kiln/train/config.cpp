// Presets, config keys, the TOML subset parser and validation for `kiln train`.
#include "kiln/train/config.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>

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

void TrainConfig::validate() const {
  auto pos = [](const char* k, int64_t v) { KILN_CHECK(v > 0, "config: ", k, "=", v, " must be positive"); };
  pos("steps", steps);
  pos("batch", batch);
  pos("seq", seq);
  pos("accum", accum);
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
                                   {"prompt", &prompt}, {"out", &out}, {"resume", &resume}})
    json::check_utf8(*value, std::string("config: ") + key, "kiln stores a run's settings as JSON, which needs UTF-8");
  KILN_CHECK(attention == "auto" || attention == "reference" || attention == "flex", "config: attention='", attention,
             "' is not one of: auto, reference, flex");
  if (attention_mask.rfind("window:", 0) == 0) {
    const std::string w = attention_mask.substr(7);
    KILN_CHECK(!w.empty() && w.size() < 10 && w.find_first_not_of("0123456789") == std::string::npos &&
                   std::stoll(w) >= 1,
               "config: attention_mask='", attention_mask, "': the window must be a positive integer (window:256)");
  } else {
    KILN_CHECK(attention_mask == "auto" || attention_mask == "causal" || attention_mask == "document",
               "config: attention_mask='", attention_mask, "' is not one of: auto, causal, window:W, document");
  }
  KILN_CHECK(attention_mask != "document" || sample == "packed", "config: attention_mask=document needs sample=packed "
             "(per-token document ids come from packed documents), got sample='", sample, "'");
  model_config(256).validate();
  KILN_CHECK(seq <= 1 << 20, "config: seq=", seq, " is too large");
  // a step's micro-batches are held at once: beyond 2^40 tokens their ids alone need 16 TiB
  // (and the products overflow long before int64 does)
  KILN_CHECK(batch <= (int64_t{1} << 40) / seq / accum, "config: batch=", batch, " x seq=", seq, " x accum=", accum,
             " is more than 2^40 tokens per step; use a smaller --batch, --seq or --accum");
}

json::Value TrainConfig::to_json() const {
  json::Value v = json::Value::object();
  v["preset"] = preset;
  v["data"] = data;
  v["tokenizer"] = tokenizer;
  v["sample"] = sample;
  v["val_fraction"] = val_fraction;
  v["hidden"] = hidden;
  v["layers"] = layers;
  v["heads"] = heads;
  v["kv_heads"] = kv_heads;
  v["intermediate"] = intermediate;
  v["rope_theta"] = rope_theta;
  v["norm_eps"] = norm_eps;
  v["init_std"] = init_std;
  v["tie_embeddings"] = tie_embeddings;
  v["attention"] = attention;
  v["attention_mask"] = attention_mask;
  v["fused_loss"] = fused_loss;
  v["vocab"] = vocab;
  v["checkpoint_activations"] = checkpoint_activations;
  v["steps"] = steps;
  v["batch"] = batch;
  v["seq"] = seq;
  v["accum"] = accum;
  v["warmup"] = warmup;
  v["lr"] = lr;
  v["min_lr_ratio"] = min_lr_ratio;
  v["weight_decay"] = weight_decay;
  v["beta1"] = beta1;
  v["beta2"] = beta2;
  v["eps"] = eps;
  v["clip"] = clip;
  v["eval_every"] = eval_every;
  v["eval_batches"] = eval_batches;
  v["ckpt_every"] = ckpt_every;
  v["keep_ckpts"] = keep_ckpts;
  v["log_every"] = log_every;
  v["telemetry_every"] = telemetry_every;
  v["max_time"] = max_time;
  v["sample_tokens"] = sample_tokens;
  v["prompt"] = prompt;
  v["out"] = out;
  v["device"] = device;
  v["dtype"] = dtype;
  v["seed"] = static_cast<int64_t>(seed);
  v["deterministic"] = deterministic;
  return v;
}

const std::vector<std::string>& changeable_on_resume() {
  static const std::vector<std::string> kKeys = {"steps",     "max_time",   "eval_every",    "ckpt_every",
                                                 "log_every", "keep_ckpts", "sample_tokens", "prompt"};
  return kKeys;
}

void set_config_value(TrainConfig& c, const std::string& key_in, const json::Value& v) {
  std::string key = key_in;
  for (char& ch : key)
    if (ch == '-') ch = '_';
  using Setter = std::function<void(TrainConfig&, const json::Value&)>;
  auto S = [](std::string TrainConfig::*m) {
    return Setter([m](TrainConfig& c, const json::Value& v) { c.*m = v.as_string(); });
  };
  auto I = [](int64_t TrainConfig::*m) {
    return Setter([m](TrainConfig& c, const json::Value& v) { c.*m = v.as_int(); });
  };
  auto D = [](double TrainConfig::*m) {
    return Setter([m](TrainConfig& c, const json::Value& v) { c.*m = v.as_double(); });
  };
  auto B = [](bool TrainConfig::*m) {
    return Setter([m](TrainConfig& c, const json::Value& v) { c.*m = v.as_bool(); });
  };
  static const std::map<std::string, Setter> setters = {
      {"preset", S(&TrainConfig::preset)}, {"data", S(&TrainConfig::data)},
      {"tokenizer", S(&TrainConfig::tokenizer)}, {"sample", S(&TrainConfig::sample)},
      {"sample_mode", S(&TrainConfig::sample)},
      {"val_fraction", D(&TrainConfig::val_fraction)}, {"hidden", I(&TrainConfig::hidden)},
      {"layers", I(&TrainConfig::layers)}, {"heads", I(&TrainConfig::heads)},
      {"kv_heads", I(&TrainConfig::kv_heads)}, {"intermediate", I(&TrainConfig::intermediate)},
      {"rope_theta", D(&TrainConfig::rope_theta)}, {"norm_eps", D(&TrainConfig::norm_eps)},
      {"init_std", D(&TrainConfig::init_std)}, {"tie_embeddings", B(&TrainConfig::tie_embeddings)},
      {"attention", S(&TrainConfig::attention)}, {"attention_mask", S(&TrainConfig::attention_mask)},
      {"profile", B(&TrainConfig::profile)}, {"fused_loss", B(&TrainConfig::fused_loss)},
      {"vocab", I(&TrainConfig::vocab)}, {"checkpoint_activations", S(&TrainConfig::checkpoint_activations)},
      {"steps", I(&TrainConfig::steps)}, {"batch", I(&TrainConfig::batch)}, {"seq", I(&TrainConfig::seq)},
      {"accum", I(&TrainConfig::accum)}, {"warmup", I(&TrainConfig::warmup)}, {"lr", D(&TrainConfig::lr)},
      {"min_lr_ratio", D(&TrainConfig::min_lr_ratio)}, {"weight_decay", D(&TrainConfig::weight_decay)},
      {"beta1", D(&TrainConfig::beta1)}, {"beta2", D(&TrainConfig::beta2)}, {"eps", D(&TrainConfig::eps)},
      {"clip", D(&TrainConfig::clip)}, {"eval_every", I(&TrainConfig::eval_every)},
      {"eval_batches", I(&TrainConfig::eval_batches)}, {"ckpt_every", I(&TrainConfig::ckpt_every)},
      {"keep_ckpts", I(&TrainConfig::keep_ckpts)}, {"log_every", I(&TrainConfig::log_every)},
      {"telemetry_every", I(&TrainConfig::telemetry_every)}, {"max_time", D(&TrainConfig::max_time)},
      {"sample_tokens", I(&TrainConfig::sample_tokens)}, {"prompt", S(&TrainConfig::prompt)},
      {"out", S(&TrainConfig::out)}, {"device", S(&TrainConfig::device)}, {"dtype", S(&TrainConfig::dtype)},
      {"deterministic", B(&TrainConfig::deterministic)}, {"overwrite", B(&TrainConfig::overwrite)},
      {"seed", Setter([](TrainConfig& c, const json::Value& v) {
         KILN_CHECK(v.as_int() >= 0, "seed must be >= 0");
         c.seed = static_cast<uint64_t>(v.as_int());
       })},
  };
  // A resumed run takes no config file (its settings are the run's), so a file cannot set it.
  KILN_CHECK(key != "resume", "config: key '", key_in, "' cannot be set in a config file: pass --resume DIR");
  auto it = setters.find(key);
  KILN_CHECK(it != setters.end(), "config: unknown key '", key_in, "'");
  try {
    it->second(c, v);
  } catch (const Error& e) {
    fail("config: key '", key_in, "' = ", v.dump(), ": ", e.what());  // the value too, as the docs say
  }
}

void apply_config_json(TrainConfig& c, const json::Value& obj) {
  for (const auto& [k, v] : obj.as_object("config")) {
    if (v.is_object()) apply_config_json(c, v);
    else set_config_value(c, k, v);
  }
}

namespace {
// A TOML number without its '_' separators: a decimal integer (no leading zeros: "010" is not 8
// nor 10 in TOML), 0x / 0o / 0b integers, or a float (inf and nan included); nullopt when the
// text is none of these; an error when it is one but does not fit (int64, or double's range).
std::optional<json::Value> parse_toml_number(const std::string& num, const std::string& where) {
  if (num.empty()) return std::nullopt;
  const bool is_float = num.find_first_of(".eE") != std::string::npos || num.find("inf") != std::string::npos ||
                        num.find("nan") != std::string::npos;
  if (num.size() > 2 && num[0] == '0' && (num[1] == 'x' || num[1] == 'o' || num[1] == 'b')) {
    const int base = num[1] == 'x' ? 16 : num[1] == 'o' ? 8 : 2;
    int64_t v = 0;
    auto [p, ec] = std::from_chars(num.data() + 2, num.data() + num.size(), v, base);
    if (ec == std::errc::invalid_argument || p != num.data() + num.size()) return std::nullopt;
    KILN_CHECK(ec == std::errc(), where, ": integer '", num, "' does not fit in 64 bits");
    return json::Value(v);
  }
  if (is_float) {
    size_t used = 0;
    double d = 0;
    try {
      d = std::stod(num, &used);
    } catch (const std::out_of_range&) {
      fail(where, ": number '", num, "' is out of the range of a double");
    } catch (...) {
      return std::nullopt;
    }
    if (used != num.size()) return std::nullopt;
    return json::Value(d);
  }
  const size_t digits = num[0] == '+' || num[0] == '-' ? 1 : 0;
  if (num.size() == digits || num.find_first_not_of("0123456789", digits) != std::string::npos) return std::nullopt;
  KILN_CHECK(!(num.size() > digits + 1 && num[digits] == '0'), where, ": integer '", num,
             "' has a leading zero, which TOML does not allow (write it without, or 0x / 0o / 0b for other bases)");
  int64_t v = 0;
  auto [p, ec] = std::from_chars(num.data() + (num[0] == '+' ? 1 : 0), num.data() + num.size(), v);
  if (ec == std::errc::invalid_argument || p != num.data() + num.size()) return std::nullopt;
  KILN_CHECK(ec == std::errc(), where, ": integer '", num, "' does not fit in 64 bits");
  return json::Value(v);
}
}  // namespace

json::Value parse_toml(const std::string& text, const std::string& source) {
  json::Value root = json::Value::object();
  json::Value* table = &root;
  // A UTF-8 byte order mark (some editors write one) is not part of the first key.
  size_t line_no = 0, pos = text.rfind("\xEF\xBB\xBF", 0) == 0 ? 3 : 0;
  auto trim = [](std::string s) {
    size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
  };
  while (pos <= text.size()) {
    size_t nl = text.find('\n', pos);
    std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    pos = nl == std::string::npos ? text.size() + 1 : nl + 1;
    ++line_no;
    // strip comments outside strings
    bool in_s = false;
    char q = 0;
    for (size_t i = 0; i < line.size(); ++i) {
      char ch = line[i];
      if (in_s) {
        if (ch == '\\' && q == '"') ++i;
        else if (ch == q) in_s = false;
      } else if (ch == '"' || ch == '\'') {
        in_s = true;
        q = ch;
      } else if (ch == '#') {
        line.resize(i);
        break;
      }
    }
    line = trim(line);
    if (line.empty()) continue;
    auto where = [&]() { return source + ":" + std::to_string(line_no); };
    if (line.front() == '[') {
      KILN_CHECK(line.back() == ']' && line.size() > 2, where(), ": bad table header '", line, "'");
      std::string name = trim(line.substr(1, line.size() - 2));
      KILN_CHECK(!name.empty() && name.find_first_of("[]\"' ") == std::string::npos, where(), ": bad table name '",
                 name, "'");
      KILN_CHECK(!root.contains(name), where(), ": table [", name, "] defined twice");
      root[name] = json::Value::object();
      table = &root[name];
      continue;
    }
    size_t eq = line.find('=');
    KILN_CHECK(eq != std::string::npos, where(), ": expected 'key = value', got '", line, "'");
    std::string key = trim(line.substr(0, eq)), val = trim(line.substr(eq + 1));
    KILN_CHECK(!key.empty() && key.find_first_of(" \t\"'") == std::string::npos, where(), ": bad key '", key, "'");
    KILN_CHECK(!val.empty(), where(), ": missing value for '", key, "'");
    KILN_CHECK(!table->contains(key), where(), ": key '", key, "' defined twice");
    json::Value v;
    if (val.front() == '"') {
      KILN_CHECK(val.size() >= 2 && val.back() == '"', where(), ": unterminated string");
      try {
        v = json::parse(val);  // TOML basic strings use JSON's escapes
      } catch (const Error& e) {
        fail(where(), ": string value of '", key, "': ", e.what());
      }
    } else if (val.front() == '\'') {
      KILN_CHECK(val.size() >= 2 && val.back() == '\'', where(), ": unterminated string");
      v = val.substr(1, val.size() - 2);
    } else if (val == "true" || val == "false") {
      v = val == "true";
    } else {
      std::string num;
      for (size_t i = 0; i < val.size(); ++i) {
        if (val[i] != '_') {
          num.push_back(val[i]);
          continue;
        }
        // TOML allows '_' only between two digits (1_000, 0xff_ff); 1__0, 4_ and 1_e5 are not numbers.
        const bool hex = val.size() > 2 && val[0] == '0' && val[1] == 'x';
        auto digit = [&](char ch) {
          const auto u = static_cast<unsigned char>(ch);
          return hex ? std::isxdigit(u) != 0 : std::isdigit(u) != 0;
        };
        KILN_CHECK(i > 0 && i + 1 < val.size() && digit(val[i - 1]) && digit(val[i + 1]), where(), ": value '", val,
                   "': TOML allows '_' only between two digits");
      }
      std::optional<json::Value> n = parse_toml_number(num, where());
      KILN_CHECK(n.has_value(), where(), ": value '", val,
                 "' is not a string, number or boolean (kiln reads a TOML subset)");
      v = std::move(*n);
    }
    (*table)[key] = std::move(v);
  }
  return root;
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
    doc = parse_toml(text, path);
  }
  apply_config_json(c, doc);
}

}  // namespace kiln::train
