// Bindings of kiln/train and kiln/nn's generation: train() runs kiln's trainer in this process
// from a config (a preset, then a TOML/JSON file or a dict, then keyword overrides, as
// `kiln train` builds it from --preset, --config and flags) with a Python callback per logged
// step (each metrics.jsonl record); generate() samples from a checkpoint. The GIL is released
// while they run and taken back for the callback; an exception in the callback, or Ctrl-C,
// stops the run after the step (with a checkpoint, as a signal to `kiln train` does) and is
// raised again when train() returns.
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>

#include "kiln/data/tokenizer.h"
#include "kiln/io/json.h"
#include "kiln/nn/generate.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/config.h"
#include "kiln/train/trainer.h"
#include "python/src/bindings.h"

namespace kiln::python {
namespace {

// The config: `config_json` (an object) or `config_path` (TOML or JSON file) on its preset
// (its "preset" key, else small), then `overrides_json` (an object of keys).
train::TrainConfig build_config(const std::string& config_json, const std::string& config_path,
                                const std::string& overrides_json) {
  auto apply = [&](train::TrainConfig& c) {
    if (!config_path.empty()) train::apply_config_file(c, config_path);
    if (!config_json.empty()) train::apply_config_json(c, json::parse(config_json));
    if (!overrides_json.empty()) train::apply_config_json(c, json::parse(overrides_json));
  };
  train::TrainConfig c = train::preset("small");
  apply(c);
  if (c.preset != "small") {  // the config chose a preset: rebuild on it
    train::TrainConfig p = train::preset(c.preset);
    apply(p);
    c = p;
  }
  c.validate();
  return c;
}

nb::dict summary_dict(const train::TrainSummary& s) {
  nb::dict d;
  d["start_step"] = s.start_step;
  d["steps_done"] = s.steps_done;
  d["first_loss"] = s.first_loss;
  d["final_loss"] = s.final_loss;
  d["final_eval_loss"] = s.final_eval_loss >= 0 ? nb::cast(s.final_eval_loss) : nb::none();
  d["tokens_per_s"] = s.tokens_per_s;
  d["seconds"] = s.seconds;
  d["num_parameters"] = s.num_parameters;
  d["tokens_seen"] = s.tokens_seen;
  d["peak_memory_bytes"] = s.peak_memory_bytes;
  d["interrupted"] = s.interrupted;
  d["out_of_time"] = s.out_of_time;
  d["already_done"] = s.already_done;
  d["checkpoint"] = s.checkpoint;
  d["sample"] = s.sample;
  d["losses"] = nb::cast(s.losses);
  return d;
}

nb::dict run_train(const std::string& config_json, const std::string& config_path, const std::string& overrides_json,
                   std::optional<nb::callable> callback, bool progress) {
  train::TrainConfig cfg = build_config(config_json, config_path, overrides_json);
  std::atomic<bool> stop{false};
  std::optional<nb::python_error> raised;
  train::TrainHooks hooks;
  hooks.stop = &stop;
  hooks.progress = progress ? stderr : nullptr;
  hooks.on_log = [&](const json::Value& record) {
    nb::gil_scoped_acquire gil;
    if (raised) return;
    try {
      if (callback) (*callback)(record.dump());
      if (PyErr_CheckSignals() != 0) throw nb::python_error();  // Ctrl-C while training
    } catch (nb::python_error& e) {
      raised.emplace(std::move(e));
      stop = true;
    }
  };
  hooks.on_step = [&](int64_t) {
    if (raised) return;
    nb::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) {
      raised.emplace();
      stop = true;
    }
  };
  train::TrainSummary s;
  {
    nb::gil_scoped_release nogil;
    s = train::run_training(cfg, hooks);
  }
  if (raised) throw std::move(*raised);
  return summary_dict(s);
}

std::tuple<nb::bytes, std::vector<int32_t>> run_generate(const std::string& ckpt, const std::string& prompt,
                                                           int64_t max_tokens, double temperature, int64_t top_k,
                                                           double top_p, int64_t seed, const std::string& device,
                                                           const std::string& tokenizer) {
  nn::GenerateOptions o = nn::generate_options(max_tokens, temperature, top_k, top_p, seed, "kiln.generate");
  const Device dev = Device::parse(device);
  check_device_available(dev, "kiln.generate");
  nb::gil_scoped_release nogil;
  const std::string dir = train::find_checkpoint(ckpt);
  KILN_CHECK(!dir.empty(), "kiln.generate: no checkpoint (config.json) in '", ckpt, "'", train::why_no_checkpoint(ckpt));
  auto model = train::load_model(dir, dev);
  model->eval();
  auto tok = train::load_tokenizer_for(*model, dir, tokenizer, "kiln.generate");
  const std::vector<int32_t> ids = nn::encode_prompt(*tok, prompt, o);
  std::vector<int32_t> out = nn::generate(*model, ids, o);
  if (!out.empty() && out.back() == tok->eos_id()) out.pop_back();
  const std::vector<int32_t> tail(ids.end() - std::min<std::ptrdiff_t>(8, std::ssize(ids)), ids.end());
  const std::string text = tok->decode_continuation(tail, out);
  nb::gil_scoped_acquire gil;
  return {nb::bytes(text.data(), text.size()), out};  // bytes: a byte-level model may end mid-character
}

}  // namespace

void bind_train(nb::module_& m) {
  m.def("train", &run_train, nb::arg("config_json"), nb::arg("config_path"), nb::arg("overrides_json"),
        nb::arg("callback").none(), nb::arg("progress"));
  m.def("config_json", [](const std::string& config_json, const std::string& config_path,
                          const std::string& overrides_json) {
    return build_config(config_json, config_path, overrides_json).to_json().dump();
  }, nb::arg("config_json"), nb::arg("config_path"), nb::arg("overrides_json"),
        "the complete config train() would run (JSON), validated");
  m.def("generate", &run_generate, nb::arg("ckpt"), nb::arg("prompt"), nb::kw_only(), nb::arg("max_tokens") = 200,
        nb::arg("temperature") = 0.8, nb::arg("top_k") = 40, nb::arg("top_p") = 0.95, nb::arg("seed") = 0,
        nb::arg("device") = "cpu", nb::arg("tokenizer") = "");
}

}  // namespace kiln::python
