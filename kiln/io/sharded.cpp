// Hugging Face sharded checkpoints: writing shards + index, reading and checking an index,
// finding the checkpoint in a folder.
#include "kiln/io/sharded.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>

#include "kiln/core/error.h"
#include "kiln/io/file.h"
#include "kiln/io/json.h"

namespace kiln::io {

namespace fs = std::filesystem;

namespace {
// Removes `name` from `dir` if an earlier save left it there: a folder holds one checkpoint,
// and the other form would shadow the new one (kiln reads an index before model.safetensors,
// Hugging Face model.safetensors before an index).
void remove_other_form(const std::string& dir, const char* name) {
  std::error_code ec;
  fs::remove(fs::path(dir) / name, ec);
  KILN_CHECK(!ec, "save_sharded: cannot remove the stale ", (fs::path(dir) / name).string(),
             " of an earlier save: ", ec.message());
}
}  // namespace

bool is_sharded_file_name(const std::string& name) {
  if (name == "model.safetensors" || name == kIndexFile) return true;
  const std::string pre = "model-", mid = "-of-", suf = ".safetensors";  // model-00001-of-00003.safetensors
  if (name.size() <= pre.size() + suf.size() || !name.starts_with(pre) || !name.ends_with(suf)) return false;
  auto digits = [&](size_t b, size_t e) {
    return e >= b + 5 && std::all_of(name.begin() + b, name.begin() + e, [](char c) { return c >= '0' && c <= '9'; });
  };
  const size_t m = name.find(mid, pre.size());
  return m != std::string::npos && digits(pre.size(), m) && digits(m + mid.size(), name.size() - suf.size());
}

std::vector<std::string> save_sharded(const std::string& dir, const StoredTensors& tensors, uint64_t max_shard_bytes,
                                      const Metadata& metadata) {
  KILN_CHECK(max_shard_bytes > 0, "save_sharded: max_shard_bytes must be positive");
  std::error_code ec;
  fs::create_directories(dir, ec);
  KILN_CHECK(is_directory(dir), "save_sharded: cannot create folder ", dir, ": ", ec.message());
  // Greedy packing in name order.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensors[a].name < tensors[b].name; });
  std::vector<StoredTensors> shards;
  uint64_t in_shard = 0, total = 0;
  for (size_t i : order) {
    const uint64_t nb = tensors[i].nbytes();
    if (shards.empty() || (in_shard > 0 && in_shard + nb > max_shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(tensors[i]);
    in_shard += nb;
    total += nb;
  }
  if (shards.empty()) shards.emplace_back();
  std::vector<std::string> written;
  if (shards.size() == 1) {
    std::string path = (fs::path(dir) / "model.safetensors").string();
    save_safetensors(path, shards[0], metadata);
    remove_other_form(dir, kIndexFile);
    written.push_back(path);
    return written;
  }
  json::Value weight_map = json::Value::object();
  std::vector<std::pair<std::string, std::string>> entries;
  for (size_t k = 0; k < shards.size(); ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    std::string path = (fs::path(dir) / name).string();
    save_safetensors(path, shards[k], metadata);
    written.push_back(path);
    for (const auto& s : shards[k]) entries.emplace_back(s.name, name);
  }
  std::sort(entries.begin(), entries.end());
  for (auto& [n, f] : entries) weight_map.as_object().emplace_back(n, json::Value(f));
  json::Value doc = json::Value::object();
  doc["metadata"]["total_size"] = total;
  doc["weight_map"] = std::move(weight_map);
  std::string text = doc.dump(2) + "\n";
  std::string index = (fs::path(dir) / kIndexFile).string();
  AtomicWriter w(index);
  w.write(text.data(), text.size());
  w.commit();
  remove_other_form(dir, "model.safetensors");
  written.push_back(index);
  return written;
}

std::vector<std::string> save_sharded(const std::string& dir, const TensorMap& tensors, uint64_t max_shard_bytes,
                                      const Metadata& metadata) {
  return save_sharded(dir, to_stored(tensors), max_shard_bytes, metadata);
}

ShardIndex read_shard_index(const std::string& index_path) {
  constexpr size_t kMaxIndex = 64 << 20;
  std::string text = read_file_prefix(index_path, kMaxIndex + 1);
  KILN_CHECK(text.size() <= kMaxIndex, index_path, ": index file larger than ", kMaxIndex, " bytes");
  json::Value doc;
  try {
    doc = json::parse(text);
  } catch (const Error& e) {
    fail(index_path, ": not a valid sharded-checkpoint index: ", e.what());
  }
  KILN_CHECK(doc.is_object(), index_path, ": index is not a JSON object");
  const json::Value* wm = doc.find("weight_map");
  KILN_CHECK(wm && wm->is_object(), index_path, ": index has no \"weight_map\" object");
  ShardIndex idx;
  const fs::path parent = fs::path(index_path).parent_path();
  idx.dir = parent.empty() ? fs::path(".").string() : parent.string();
  if (const json::Value* md = doc.find("metadata")) {
    KILN_CHECK(md->is_object(), index_path, ": \"metadata\" is not an object");
    if (const json::Value* ts = md->find("total_size")) {
      KILN_CHECK(ts->is_number() && ts->as_double() >= 0, index_path, ": metadata.total_size is not a non-negative number");
      idx.total_size = static_cast<int64_t>(ts->as_double());
    }
  }
  std::set<std::string> shards;
  for (const auto& [name, file] : wm->as_object()) {
    KILN_CHECK(file.is_string(), index_path, ": weight_map[\"", name, "\"] is not a string");
    const std::string& f = file.as_string();
    KILN_CHECK(!f.empty() && f.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos && f != "." &&
                   f != "..",
               index_path, ": weight_map[", json::quote(name), "] = ", json::quote(f),
               " is not a file name in the index's folder");
    idx.weight_map.emplace_back(name, f);
    shards.insert(f);
  }
  std::sort(idx.weight_map.begin(), idx.weight_map.end());
  idx.shards.assign(shards.begin(), shards.end());
  return idx;
}

std::string checkpoint_in_folder(const std::string& dir) {
  for (const char* name : {kIndexFile, "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin"}) {
    fs::path p = fs::path(dir) / name;
    if (fs::exists(p)) return p.string();
  }
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file() && e.path().extension() == ".safetensors") found.push_back(e.path().string());
  KILN_CHECK(found.size() == 1, dir, ": folder holds ", found.size(), " .safetensors files and no ", kIndexFile,
             " (expected a checkpoint folder: an index, model.safetensors, or a single .safetensors file)");
  return found[0];
}

}  // namespace kiln::io
