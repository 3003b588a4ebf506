// kiln convert --hf: a checkpoint (sharded or not) -> one model -> save_checkpoint's layout.
#include "kiln/train/hf_export.h"

#include <filesystem>
#include <set>

#include "kiln/data/tokenizer.h"
#include "kiln/parallel/dcp.h"

namespace kiln::train {

namespace fs = std::filesystem;

std::unique_ptr<nn::LlamaForCausalLM> load_consolidated(const std::string& dir, Device device) {
  KILN_CHECK(fs::is_directory(dir), "checkpoint: '", dir, "' is not a folder");
  if (!fs::exists(fs::path(dir) / parallel::kShardedIndexFile)) return load_model(dir, device);  // one process
  auto model = model_from_config(dir, device);
  std::vector<parallel::ShardedTensor> targets;
  std::set<std::string> names;
  for (auto& [name, p] : model->named_parameters()) {
    KILN_CHECK(p->dtype() == DType::f32 && p->is_contiguous(), "load_consolidated: parameter '", name,
               "' is not a contiguous f32 tensor");
    targets.push_back({name, p->shape(), 0, *p});  // shares the parameter's storage: filled in place
    names.insert(name);
  }
  // Everything else must be an optimizer buffer ("exp_avg.<parameter>"): a tensor of another
  // model (an lm_head.weight where config.json says the embeddings are tied) is not dropped silently.
  for (const auto& e : parallel::checkpoint_entries(dir)) {
    if (names.count(e.name)) continue;
    const auto dot = e.name.find('.');
    KILN_CHECK(dot != std::string::npos && names.count(e.name.substr(dot + 1)), "checkpoint ", dir, ": tensor '",
               e.name, "' is neither a parameter of the model its config.json describes nor an optimizer buffer of one");
  }
  parallel::load_sharded(dir, targets);  // checks every chunk of every file first; a missing parameter is named
  return model;
}

namespace {

// Whether `inner` is `outer` or inside it (both made absolute, '..' and links resolved where they exist).
bool is_within(const fs::path& inner, const fs::path& outer) {
  const fs::path a = fs::weakly_canonical(fs::absolute(inner)), b = fs::weakly_canonical(fs::absolute(outer));
  auto ia = a.begin(), ib = b.begin();
  for (; ib != b.end(); ++ia, ++ib) {
    if (ib->empty()) continue;  // a trailing separator
    if (ia == a.end() || *ia != *ib) return false;
  }
  return true;
}

}  // namespace

HfExportResult export_hf(const std::string& in, const std::string& out, const HfExportOptions& o) {
  HfExportResult r;
  KILN_CHECK(!out.empty(), "convert: OUT is empty");
  if (o.step >= 0) {
    r.checkpoint = (fs::path(in) / ("step-" + std::to_string(o.step))).string();
    KILN_CHECK(fs::exists(fs::path(r.checkpoint) / "config.json"), "convert: ", r.checkpoint,
               fs::exists(r.checkpoint) ? " has no config.json (not a checkpoint)" : " does not exist",
               why_no_checkpoint(in));
  } else {
    r.checkpoint = find_checkpoint(in, &r.note);
    KILN_CHECK(!r.checkpoint.empty(), "convert: no checkpoint in '", in, "'", why_no_checkpoint(in));
  }
  std::error_code ec;
  if (fs::exists(out, ec)) {
    KILN_CHECK(fs::is_directory(out, ec), "convert: OUT '", out, "' is a file, not a folder");
    KILN_CHECK(!is_within(r.checkpoint, out), "convert: OUT '", out, "' is or holds the checkpoint ", r.checkpoint,
               ", which writing OUT would replace; choose another OUT");
    KILN_CHECK(o.force || fs::is_empty(out, ec), "convert: OUT '", out,
               "' is not empty; pass --force to replace it (its files are removed once the new checkpoint is complete)");
  }
  KILN_CHECK(!is_within(out, r.checkpoint), "convert: OUT '", out, "' is inside the checkpoint ", r.checkpoint,
             "; choose a folder outside it");
  // Read and check everything before OUT is touched.
  const auto model = load_consolidated(r.checkpoint);
  const fs::path ck(r.checkpoint);
  if (fs::exists(ck / parallel::kShardedIndexFile)) {
    r.sharded = true;
    const json::Value idx = read_json_file((ck / parallel::kShardedIndexFile).string());
    if (const json::Value* n = idx.find("world_size"); n && n->is_integer()) r.world_size = n->as_int();
  }
  std::unique_ptr<data::Tokenizer> tok;
  if (fs::exists(ck / "tokenizer.model") || fs::exists(ck / "tokenizer_config.json")) {
    tok = load_tokenizer_for(*model, r.checkpoint, "", "convert");
    r.tokenizer = true;
  }
  for (const auto& [n, p] : model->named_parameters()) r.parameters += p->numel();
  CheckpointData d;
  d.model = model.get();
  d.tokenizer = tok.get();
  d.trained_seq_len = trained_seq_len(r.checkpoint);
  save_checkpoint(out, d, o.hook);  // a temporary sibling, fsynced, renamed over OUT
  return r;
}

}  // namespace kiln::train
