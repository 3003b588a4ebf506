// Atomic checkpoint directories, model state under Hugging Face names, and loading.
#include "kiln/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "kiln/autograd/grad_mode.h"
#include "kiln/io/load.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"
#include "kiln/parallel/dcp.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  KILN_CHECK(fd >= 0, "checkpoint: cannot open '", p.string(), "' to sync it: ", errno_text());
  int rc = ::fsync(fd);
  const std::string why = rc == 0 ? "" : errno_text();
  ::close(fd);
  KILN_CHECK(rc == 0, "checkpoint: fsync of '", p.string(), "' failed: ", why);
}

}  // namespace

json::Value read_json_file(const std::string& path) {
  std::ifstream f(path);
  KILN_CHECK(f.good(), "cannot open '", path, "'");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  try {
    return json::parse(text);
  } catch (const Error& e) {
    fail(path, ": ", e.what());
  }
}

json::Value read_trainer_state(const std::string& ckpt_dir) {
  const fs::path path = fs::path(ckpt_dir) / "trainer_state.json";
  KILN_CHECK(fs::exists(path), "resume: '", ckpt_dir,
             "' has no trainer_state.json (a model-only checkpoint cannot be resumed)");
  json::Value st = read_json_file(path.string());
  for (const char* key : {"step", "sampler_position", "tokens_seen", "elapsed_s", "config", "optimizer"})
    KILN_CHECK(st.contains(key), "resume: ", path.string(), " has no '", key,
               "' (not a trainer state written by kiln train)");
  // The counters a resume restores: non-negative integers (elapsed_s a non-negative number), so
  // that a damaged file is named here instead of as "value: expected an integer" mid-resume or,
  // for a negative sampler position, taken.
  for (const char* key : {"step", "sampler_position", "tokens_seen"}) {
    const json::Value* v = st.find(key);
    KILN_CHECK(v->is_integer() && v->as_int() >= 0, "resume: ", path.string(), ": '", key, "' is ", v->dump(),
               ", not a count (a non-negative integer)");
  }
  const json::Value* e = st.find("elapsed_s");
  KILN_CHECK(e->is_number() && e->as_double() >= 0 && std::isfinite(e->as_double()), "resume: ", path.string(),
             ": 'elapsed_s' is ", e->dump(), ", not a number of seconds >= 0");
  KILN_CHECK(st.find("config")->is_object() && st.find("optimizer")->is_object(), "resume: ", path.string(),
             ": 'config' and 'optimizer' must be objects");
  return st;
}

void write_text_file_synced(const std::string& path, const std::string& text) {
  // POSIX calls, so that every failure names errno's text (a full disk said only "cannot write").
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KILN_CHECK(fd >= 0, "cannot write '", path, "': ", errno_text());
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = w < 0 ? errno_text() : "nothing written";
      ::close(fd);
      fail("cannot write '", path, "' (", done, " of ", text.size(), " bytes written): ", why);
    }
    done += static_cast<size_t>(w);
  }
  const int rc = ::fsync(fd);
  const std::string why = rc == 0 ? "" : errno_text();
  ::close(fd);
  KILN_CHECK(rc == 0, "cannot write '", path, "': fsync failed: ", why);
}

void write_dir_atomic(const std::string& dir_s, const std::function<void(const std::string&)>& write,
                      const WriteHook& hook) {
  fs::path dir = fs::absolute(dir_s);
  fs::path parent = dir.parent_path();
  fs::create_directories(parent);
  fs::path tmp = parent / (".tmp-" + dir.filename().string() + "-" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    write(tmp.string());
    for (const auto& e : fs::directory_iterator(tmp)) {
      fsync_path(e.path());
      if (hook) hook(e.path().filename().string());
    }
    fsync_path(tmp);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  fs::path old;
  if (fs::exists(dir)) {
    old = parent / (".old-" + dir.filename().string() + "-" + std::to_string(::getpid()));
    fs::remove_all(old);
    fs::rename(dir, old);
  }
  fs::rename(tmp, dir);
  fsync_path(parent);
  if (!old.empty()) fs::remove_all(old);
}

std::vector<std::pair<std::string, Tensor>> model_state(const nn::LlamaForCausalLM& model) {
  NoGradGuard ng;
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, t] : model.named_parameters()) {
    Tensor c = t->detach();
    if (!c.is_cpu()) c = c.to(kCPU);
    if (c.dtype() != DType::f32) c = c.to(DType::f32);
    out.emplace_back(name, c.contiguous());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

namespace {
// Whether two tensors hold the same shape and values (compared as f32 on the host).
bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || !is_floating(a.dtype()) || !is_floating(b.dtype())) return false;
  auto host_f32 = [](const Tensor& t) { return (t.is_cpu() ? t : t.to(kCPU)).to(DType::f32).contiguous().to_vector<float>(); };
  return host_f32(a) == host_f32(b);
}
}  // namespace

void load_model_state(nn::LlamaForCausalLM& model, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  NoGradGuard ng;
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [n, t] : tensors) by_name[n] = &t;
  auto params = model.named_parameters();
  // Everything is checked before anything is written: a load that fails leaves the model as it
  // was (a missing layer left 15 of 30 parameters overwritten).
  std::vector<const Tensor*> sources;
  for (auto& [name, p] : params) {
    // Every parameter by its own name: an untied model's missing lm_head.weight took the
    // embedding's values without a word (a tied model has no lm_head parameter).
    auto it = by_name.find(name);
    KILN_CHECK(it != by_name.end(), "checkpoint: tensor '", name, "' is missing");
    const Tensor& src = *it->second;
    KILN_CHECK(src.shape() == p->shape(), "checkpoint: tensor '", name, "' has shape ", src.shape(),
               ", the model expects ", p->shape());
    KILN_CHECK(is_floating(src.dtype()), "checkpoint: tensor '", name, "' has dtype ", dtype_name(src.dtype()));
    sources.push_back(&src);
  }
  for (const auto& [n, t] : tensors) {
    bool known = n.find("rotary_emb") != std::string::npos;
    for (auto& [name, p] : params) known = known || name == n;
    if (n == "lm_head.weight" && model.config.tie_word_embeddings) {
      // A tied model has no lm_head of its own: a file's lm_head.weight is the embedding again
      // (as transformers saves it), or the model is not tied and dropping it is a wrong model
      // (perplexity 264 instead of 19.7).
      auto emb = by_name.find("model.embed_tokens.weight");
      KILN_CHECK(emb != by_name.end() && same_values(t, *emb->second), "checkpoint: tensor 'lm_head.weight' differs ",
                 "from 'model.embed_tokens.weight', but config.json says tie_word_embeddings: true, so it would be ",
                 "dropped; set \"tie_word_embeddings\": false in config.json to use it");
      known = true;
    }
    KILN_CHECK(known, "checkpoint: unexpected tensor '", n, "' (not a parameter of this Llama config)");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor* p = params[i].second;
    const Tensor& src = *sources[i];
    Tensor v = src.dtype() == p->dtype() ? src : src.to(p->dtype());
    if (v.device() != p->device()) v = v.to(p->device());
    // write into the existing storage so that optimizers holding the parameter see it
    p->copy_(v);
  }
}

void save_checkpoint(const std::string& dir, const CheckpointData& d, const WriteHook& hook) {
  KILN_CHECK(d.model != nullptr, "save_checkpoint: no model");
  write_dir_atomic(
      dir,
      [&](const std::string& tmp) {
        fs::path t(tmp);
        nn::LlamaConfig cfg = d.model->config;
        if (d.tokenizer) {
          cfg.bos_token_id = d.tokenizer->bos_id();
          cfg.eos_token_id = d.tokenizer->eos_id();
        }
        cfg.torch_dtype = "float32";
        json::Value cj = cfg.to_json();
        // The sequence length the model was trained at: kiln eval evaluates at it by default
        // (max_position_embeddings, at least 256, evaluated a 64-token model at 256).
        if (const json::Value* c = d.trainer_state.is_null() ? nullptr : d.trainer_state.find("config"))
          if (const json::Value* seq = c->find("seq"); seq && seq->is_integer()) cj[kTrainedSeqKey] = seq->as_int();
        if (d.trained_seq_len > 0) cj[kTrainedSeqKey] = d.trained_seq_len;
        write_text_file_synced((t / "config.json").string(), cj.dump(2) + "\n");
        io::save_safetensors((t / "model.safetensors").string(), model_state(*d.model), {{"format", "pt"}});
        if (d.tokenizer) d.tokenizer->save(tmp);
        if (!d.optimizer_tensors.empty()) {
          std::vector<std::pair<std::string, Tensor>> opt;
          for (const auto& [n, x] : d.optimizer_tensors) opt.emplace_back(n, x.is_cpu() ? x : x.to(kCPU));
          io::save_safetensors((t / "optimizer.safetensors").string(), opt);
        }
        if (!d.trainer_state.is_null())
          write_text_file_synced((t / "trainer_state.json").string(), d.trainer_state.dump(2) + "\n");
      },
      hook);
}

std::vector<std::pair<std::string, Tensor>> load_weights(const std::string& dir) {
  // The model's weights only: never the optimizer state that sits in the same directory.
  fs::path p(dir);
  if (fs::is_directory(p)) {
    if (fs::exists(p / "model.safetensors")) return io::load((p / "model.safetensors").string());
    if (fs::exists(p / "model.safetensors.index.json")) return io::load((p / "model.safetensors.index.json").string());
    if (fs::exists(p / "pytorch_model.bin.index.json")) return io::load((p / "pytorch_model.bin.index.json").string());
    if (fs::exists(p / "pytorch_model.bin")) return io::load((p / "pytorch_model.bin").string());
    fail("checkpoint: '", dir, "' has no model.safetensors, model.safetensors.index.json or pytorch_model.bin");
  }
  return io::load(dir);
}

int64_t trained_seq_len(const std::string& dir) {
  std::error_code ec;
  const fs::path config = fs::path(dir) / "config.json";
  if (!fs::exists(config, ec)) return 0;
  try {
    const json::Value v = read_json_file(config.string());
    const json::Value* seq = v.is_object() ? v.find(kTrainedSeqKey) : nullptr;
    return seq && seq->is_integer() && seq->as_int() > 0 ? seq->as_int() : 0;
  } catch (const Error&) {
    return 0;  // load_model names a damaged config.json
  }
}

std::unique_ptr<nn::LlamaForCausalLM> load_model(const std::string& dir, Device device) {
  auto model = model_from_config(dir, device);
  load_model_state(*model, load_weights(dir));
  return model;
}

std::unique_ptr<nn::LlamaForCausalLM> model_from_config(const std::string& dir, Device device) {
  fs::path p(dir);
  KILN_CHECK(fs::is_directory(p), "checkpoint: '", dir, "' is not a directory");
  const json::Value config = read_json_file((p / "config.json").string());
  // The sizes every other check divides by, named with their values before those checks run
  // ("head_dim=16 is not hidden_size/num_attention_heads" for num_attention_heads 0).
  for (const char* key : {"hidden_size", "num_attention_heads", "num_key_value_heads"})
    if (const json::Value* x = config.is_object() ? config.find(key) : nullptr; x && x->is_integer())
      KILN_CHECK(x->as_int() > 0, "checkpoint: ", (p / "config.json").string(), ": ", key, "=", x->as_int(),
                 " must be positive");
  nn::LlamaConfig cfg = nn::LlamaConfig::from_json(config);
  return std::make_unique<nn::LlamaForCausalLM>(cfg, 0, device);
}

std::unique_ptr<data::Tokenizer> load_tokenizer_for(const nn::LlamaForCausalLM& model, const std::string& dir,
                                                    const std::string& spec, const char* op) {
  auto tok = data::load_tokenizer(!spec.empty() ? spec : dir);
  KILN_CHECK(tok->vocab_size() <= model.config.vocab_size, op, ": the tokenizer has ", tok->vocab_size(),
             " ids, the model only ", model.config.vocab_size);
  // Another tokenizer than the one the checkpoint was trained with maps ids to other text (a
  // byte tokenizer on a SentencePiece model printed the prompt and nothing else).
  std::error_code ec;
  const bool saved = fs::exists(fs::path(dir) / "tokenizer.model", ec) ||
                     fs::exists(fs::path(dir) / "tokenizer_config.json", ec);
  if (!spec.empty() && saved) {
    const auto own = data::load_tokenizer(dir);
    KILN_CHECK(own->fingerprint() == tok->fingerprint(), op, ": --tokenizer ", spec, " (", tok->kind(), ", ",
               tok->vocab_size(), " ids) is not the tokenizer the checkpoint was trained with (", own->kind(), ", ",
               own->vocab_size(), " ids, saved in ", dir, "): its ids would decode to other text; leave --tokenizer out");
  }
  return tok;
}

namespace {
// The checkpoint name a run directory's `latest` file holds ("" when it has none).
std::string read_latest(const fs::path& run) {
  std::ifstream f(run / "latest");
  std::string name;
  std::getline(f, name);
  return name;
}
// A folder kiln wrote as a checkpoint: named step-N (N digits only) and holding a checkpoint's
// files. A user's step-notes/ (or step-5-old/) is none: --overwrite removed it.
bool is_checkpoint_dir(const fs::directory_entry& e) {
  std::error_code ec;
  const std::string name = e.path().filename().string();
  if (!e.is_directory(ec) || name.size() <= 5 || name.rfind("step-", 0) != 0 ||
      name.find_first_not_of("0123456789", 5) != std::string::npos)
    return false;
  for (const char* f : {"config.json", "model.safetensors", "model.safetensors.index.json", "optimizer.safetensors",
                        "trainer_state.json"})
    if (fs::exists(e.path() / f, ec)) return true;
  return false;
}
// The run directory's step-N folders by N, oldest first (a step-* name whose N is no number is
// skipped).
std::vector<std::pair<int64_t, fs::path>> step_dirs(const fs::path& run) {
  std::vector<std::pair<int64_t, fs::path>> steps;
  for (const auto& e : fs::directory_iterator(run)) {
    if (!is_checkpoint_dir(e)) continue;
    try {
      steps.emplace_back(std::stoll(e.path().filename().string().substr(5)), e.path());
    } catch (...) {
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}
// A checkpoint folder with its config and weights: model.safetensors (or a Hugging Face index),
// or a sharded checkpoint whose index parallel::checkpoint_entries accepts (every chunk there,
// none overlapping, each in a shard file that holds it).
bool whole_checkpoint(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / "config.json", ec)) return false;
  if (fs::exists(dir / "model.safetensors", ec) || fs::exists(dir / "model.safetensors.index.json", ec)) return true;
  if (!fs::exists(dir / parallel::kShardedIndexFile, ec)) return false;
  try {
    return !parallel::checkpoint_entries(dir.string()).empty();
  } catch (const Error&) {
    return false;  // a damaged index or shard file: not a whole checkpoint
  }
}
}  // namespace

std::string find_checkpoint(const std::string& dir, std::string* note) {
  fs::path p(dir);
  std::error_code ec;
  if (fs::exists(p / "config.json", ec)) return p.string();
  const std::string name = read_latest(p);
  if (!name.empty() && fs::exists(p / name / "config.json", ec)) return (p / name).string();
  // A damaged `latest` (cut short, emptied, naming a checkpoint that is gone): the newest whole
  // checkpoint there is the run's, as `latest` names only checkpoints already in place.
  if (!fs::exists(p / "latest", ec) || !fs::is_directory(p, ec)) return "";
  const auto steps = step_dirs(p);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it)
    if (whole_checkpoint(it->second)) {
      if (note)
        *note = "note: " + (p / "latest").string() + (name.empty() ? " is empty" : " names '" + name + "', which is not a checkpoint") +
                ": using the newest whole checkpoint there, " + it->second.string();
      return it->second.string();
    }
  return "";
}

std::string why_no_checkpoint(const std::string& dir) {
  const fs::path p(dir);
  std::error_code ec;
  if (!fs::exists(p, ec)) return " (no such folder)";
  if (!fs::is_directory(p, ec)) return " (not a folder)";
  std::vector<fs::path> steps;
  for (const auto& [n, path] : step_dirs(p))
    if (fs::exists(path / "config.json")) steps.push_back(path);
  std::string listed;
  for (const auto& s : steps) listed += (listed.empty() ? "" : ", ") + s.filename().string();
  if (steps.empty()) return " (no config.json, no 'latest' naming a checkpoint, no step-* checkpoint)";
  const std::string name = read_latest(p);
  const std::string latest = !fs::exists(p / "latest") ? "it has no 'latest' file"
                             : name.empty()            ? "its 'latest' file is empty"
                                                       : "its 'latest' names '" + name + "', which has no config.json";
  return " (" + latest + "; checkpoints there: " + listed + "; pass one, e.g. " + steps.back().string() + ")";
}

void mark_latest(const std::string& run_dir, const std::string& name, int64_t keep) {
  fs::path run(run_dir);
  fs::path tmp = run / ".latest.tmp";
  write_text_file_synced(tmp.string(), name + "\n");
  fs::rename(tmp, run / "latest");
  fsync_path(run);
  std::vector<std::pair<int64_t, fs::path>> steps = step_dirs(run);
  std::erase_if(steps, [&](const auto& s) { return s.second.filename() == name; });
  while (static_cast<int64_t>(steps.size()) + 1 > keep) {
    std::error_code ec;
    fs::remove_all(steps.front().second, ec);
    steps.erase(steps.begin());
  }
}

EarlierRun earlier_run(const std::string& run_dir) {
  const fs::path run(run_dir);
  std::error_code ec;
  if (!fs::is_directory(run, ec)) return {};
  if (fs::exists(run / "latest", ec)) return {"checkpoint " + read_latest(run), true};
  for (const auto& e : fs::directory_iterator(run, ec))
    if (is_checkpoint_dir(e)) return {"checkpoint " + e.path().filename().string(), true};
  const fs::path metrics = run / "metrics.jsonl";
  if (fs::exists(metrics, ec) && fs::file_size(metrics, ec) > 0) return {"metrics.jsonl", false};
  return {};
}

void remove_earlier_run(const std::string& run_dir) {
  const fs::path run(run_dir);
  std::vector<fs::path> doomed;
  for (const auto& e : fs::directory_iterator(run))
    if (is_checkpoint_dir(e)) doomed.push_back(e.path());
  for (const char* f : {"latest", "metrics.jsonl", "loss.svg", "profile.json"}) doomed.push_back(run / f);
  for (const auto& p : doomed) {
    std::error_code ec;
    fs::remove_all(p, ec);
    KILN_CHECK(!ec, "train: cannot remove ", p.string(), " of the earlier run: ", ec.message());
  }
}

}  // namespace kiln::train
