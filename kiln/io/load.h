// kiln::io::load: reads any checkpoint kiln knows, choosing the reader by the file's content
// (never its extension): safetensors; a Hugging Face sharded index (model.safetensors.index.json,
// pytorch_model.bin.index.json) or a checkpoint folder; PyTorch zip checkpoints (.pt/.bin,
// read by a restricted unpickler that never runs code from the file). Anything else gets a
// kiln::Error saying what the file is and what to do.
#pragma once
#include <string>
#include <vector>

#include "kiln/io/safetensors.h"

namespace kiln::io {

enum class FileFormat { safetensors, index_json, folder, torch_zip, torch_legacy, unknown };
const char* format_name(FileFormat f);
// What `path` holds, judged from its first bytes (or a folder).
FileFormat sniff_format(const std::string& path);

TensorMap load(const std::string& path);  // format sniffed by content; HF sharded index / folder too
// Same, keeping raw dtypes (as StoredTensor bytes) and the metadata (safetensors files only).
StoredTensors load_stored(const std::string& path, Metadata* metadata = nullptr);
// The files load(path) reads: the file itself, a folder's checkpoint file, an index and its shards.
std::vector<std::string> checkpoint_files(const std::string& path);

}  // namespace kiln::io
