// Format sniffing and kiln::io::load (see load.h).
#include "kiln/io/load.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "kiln/core/error.h"
#include "kiln/io/file.h"
#include "kiln/io/sharded.h"
#include "kiln/io/torch_pt.h"

namespace kiln::io {

const char* format_name(FileFormat f) {
  switch (f) {
    case FileFormat::safetensors: return "safetensors";
    case FileFormat::index_json: return "sharded-checkpoint index";
    case FileFormat::folder: return "checkpoint folder";
    case FileFormat::torch_zip: return "PyTorch zip checkpoint";
    case FileFormat::torch_legacy: return "legacy PyTorch pickle";
    case FileFormat::unknown: return "unknown";
  }
  return "?";
}

FileFormat sniff_format(const std::string& path) {
  if (is_directory(path)) return FileFormat::folder;
  const std::string head = read_file_prefix(path, 16);
  auto u = [&](size_t i) { return static_cast<uint8_t>(head[i]); };
  if (head.size() >= 4 && head.compare(0, 4, "PK\x03\x04") == 0) return FileFormat::torch_zip;
  if (head.size() >= 9 && head[8] == '{') {
    // A JSON text also starts with '{': then the length prefix must be plausible.
    uint64_t n = 0;
    for (size_t k = 8; k-- > 0;) n = (n << 8) | u(k);
    if (head[0] != '{' || n <= kMaxSafetensorsHeader) return FileFormat::safetensors;
  }
  // A pickle (protocol 2+) whose first item is LONG1: torch's legacy magic number.
  if (head.size() >= 3 && u(0) == 0x80 && u(1) >= 2 && u(1) <= 5 && u(2) == 0x8a) return FileFormat::torch_legacy;
  size_t i = 0;
  while (i < head.size() && (head[i] == ' ' || head[i] == '\n' || head[i] == '\r' || head[i] == '\t')) ++i;
  if (i < head.size() && head[i] == '{') return FileFormat::index_json;
  return FileFormat::unknown;
}

namespace {

std::string describe_unknown(const std::string& path) {
  const std::string head = read_file_prefix(path, 16);
  std::string what = "unrecognised content";
  if (head.empty()) what = "an empty file";
  else if (head.compare(0, 6, "\x93NUMPY") == 0) what = "a numpy .npy array";
  else if (head.compare(0, 4, "GGUF") == 0) what = "a GGUF file";
  else if (head.compare(0, 2, "\x1f\x8b") == 0) what = "a gzip stream";
  else if (static_cast<uint8_t>(head[0]) == 0x80) what = "a Python pickle that is not a PyTorch checkpoint";
  else if (head.size() >= 8) what = "bytes that are neither safetensors (8-byte length then '{') nor a zip archive";
  std::string hex;
  for (size_t k = 0; k < std::min<size_t>(head.size(), 8); ++k) {
    const char* d = "0123456789abcdef";
    hex += d[static_cast<uint8_t>(head[k]) >> 4];
    hex += d[static_cast<uint8_t>(head[k]) & 15];
  }
  return path + ": " + what + " (first bytes " + hex +
         "); kiln reads safetensors, Hugging Face sharded checkpoints and PyTorch zip checkpoints (torch.save)";
}

StoredTensors load_index(const std::string& index_path, Metadata* metadata) {
  ShardIndex idx = read_shard_index(index_path);
  StoredTensors out;
  std::set<std::string> seen;
  for (const auto& shard : idx.shards) {
    const std::string p = (std::filesystem::path(idx.dir) / shard).string();
    const FileFormat f = sniff_format(p);  // an index naming an index (itself) would recurse without end
    KILN_CHECK(f != FileFormat::index_json && f != FileFormat::folder, index_path, ": shard ", shard, " is a ",
               format_name(f), ", not a checkpoint file");
    StoredTensors part = load_stored(p, out.empty() ? metadata : nullptr);  // metadata of the first shard
    for (auto& s : part) {
      auto it = std::lower_bound(idx.weight_map.begin(), idx.weight_map.end(), std::make_pair(s.name, std::string()));
      KILN_CHECK(it != idx.weight_map.end() && it->first == s.name, index_path, ": shard ", shard, " holds tensor '",
                 s.name, "', which the weight_map does not list");
      KILN_CHECK(it->second == shard, index_path, ": tensor '", s.name, "' is in shard ", shard,
                 " but the weight_map says ", it->second);
      seen.insert(s.name);
      out.push_back(std::move(s));
    }
  }
  for (const auto& [name, shard] : idx.weight_map)
    KILN_CHECK(seen.count(name), index_path, ": weight_map lists tensor '", name, "' in ", shard,
               ", which that shard does not hold");
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

}  // namespace

StoredTensors load_stored(const std::string& path, Metadata* metadata) {
  switch (sniff_format(path)) {
    case FileFormat::safetensors: {
      SafetensorsFile f = SafetensorsFile::open(path);
      if (metadata) *metadata = f.metadata();
      return f.tensors();
    }
    case FileFormat::index_json: return load_index(path, metadata);
    case FileFormat::folder: {
      const std::string inner = checkpoint_in_folder(path);
      KILN_CHECK(!is_directory(inner), path, ": no checkpoint in folder");
      return load_stored(inner, metadata);
    }
    case FileFormat::torch_zip: return to_stored(load_torch_zip(path));
    case FileFormat::torch_legacy:
      fail(path, ": a legacy PyTorch checkpoint (the pre-1.6 pickle format), which kiln does not read: "
                 "load it with torch.load and save it again with torch.save (zip format) or "
                 "safetensors.torch.save_file");
    case FileFormat::unknown: fail(describe_unknown(path));
  }
  fail(path, ": unreadable");
}

std::vector<std::string> checkpoint_files(const std::string& path) {
  switch (sniff_format(path)) {
    case FileFormat::folder: return checkpoint_files(checkpoint_in_folder(path));
    case FileFormat::index_json: {
      ShardIndex idx = read_shard_index(path);
      std::vector<std::string> files{path};
      for (const auto& shard : idx.shards) files.push_back((std::filesystem::path(idx.dir) / shard).string());
      return files;
    }
    default: return {path};
  }
}

TensorMap load(const std::string& path) { return to_tensor_map(load_stored(path), path); }

}  // namespace kiln::io
