// `kiln inspect FILE [--json]`: lists the tensors of any checkpoint kiln::io::load reads
// (dtype, shape, bytes), its metadata and totals. FILE may be a safetensors file, a sharded
// checkpoint's index or folder, a PyTorch zip checkpoint, or a training run's or checkpoint's folder
// (its model's weights). Raw dtypes (F4, U32, ...) show too.
#include <cstdio>
#include <filesystem>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/io/json.h"
#include "kiln/io/load.h"
#include "kiln/train/checkpoint.h"

namespace kiln::cli {

namespace {
// Control characters (ESC, BEL, CR, ...) and DEL as \xNN, a backslash as \\; other bytes as they are
// (names are UTF-8, checked by the readers).
std::string escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}
}  // namespace

int run_inspect(const Args& args) {
  std::string path;
  bool as_json = false;
  ArgParser p("inspect", "List the tensors of a checkpoint: names, dtypes, shapes, bytes, metadata and totals.\n"
                         "FILE: safetensors, a sharded index (model.safetensors.index.json) or folder, or a\n"
                         "PyTorch zip checkpoint (.pt/.bin, read without running its pickle).");
  p.positional("FILE", &path, "checkpoint file or folder");
  p.flag("--json", &as_json, "print one JSON object instead of a table");
  if (!p.parse(args)) return 0;
  // A training run's folder or a checkpoint folder (as eval and generate take them): its model's
  // weights (the folder also holds optimizer.safetensors, so as a folder of tensors it failed).
  std::error_code ec;
  if (const std::string ck = std::filesystem::is_directory(path, ec) ? train::find_checkpoint(path) : ""; !ck.empty()) {
    for (const char* name : {"model.safetensors.index.json", "model.safetensors"})
      if (std::filesystem::exists(std::filesystem::path(ck) / name)) {
        path = (std::filesystem::path(ck) / name).string();
        break;
      }
  }

  const io::FileFormat format = io::sniff_format(path);
  io::Metadata metadata;
  io::StoredTensors tensors = io::load_stored(path, &metadata);
  uint64_t total_bytes = 0, total_elements = 0;
  json::Value list = json::Value::array();
  for (const auto& t : tensors) {
    const uint64_t nb = t.nbytes();
    total_bytes += nb;
    total_elements += static_cast<uint64_t>(shape_numel(t.shape));
    if (as_json) {
      json::Value o = json::Value::object();
      o["name"] = t.name;
      o["dtype"] = t.dtype;
      json::Value sh = json::Value::array();
      for (int64_t d : t.shape) sh.push_back(d);
      o["shape"] = std::move(sh);
      o["bytes"] = nb;
      o["raw"] = t.raw();
      list.push_back(std::move(o));
    }
  }
  if (as_json) {
    json::Value doc = json::Value::object();
    doc["file"] = path;
    doc["format"] = io::format_name(format);
    json::Value md = json::Value::object();
    for (const auto& [k, v] : metadata) md[k] = v;
    doc["metadata"] = std::move(md);
    doc["tensors"] = std::move(list);
    doc["total_tensors"] = static_cast<int64_t>(tensors.size());
    doc["total_elements"] = total_elements;
    doc["total_bytes"] = total_bytes;
    std::printf("%s\n", doc.dump().c_str());
    return 0;
  }
  std::printf("%s: %s, %zu tensors, %llu elements, %llu bytes\n", path.c_str(), io::format_name(format),
              tensors.size(), static_cast<unsigned long long>(total_elements),
              static_cast<unsigned long long>(total_bytes));
  // Names and metadata come from the file: escaped, so that a crafted name cannot send terminal
  // escape sequences (clear the screen, retitle the window, hide lines) through the table.
  for (const auto& [k, v] : metadata)
    std::printf("  metadata %s = %s\n", escaped(k).c_str(), escaped(v).c_str());
  for (const auto& t : tensors)
    std::printf("  %-48s %-12s %-24s %14llu%s\n", escaped(t.name).c_str(), escaped(t.dtype).c_str(),
                shape_str(t.shape).c_str(), static_cast<unsigned long long>(t.nbytes()), t.raw() ? "  (raw bytes)" : "");
  return 0;
}

}  // namespace kiln::cli
