// Sharded checkpoints in Hugging Face's layout: model-00001-of-00003.safetensors, ... plus
// model.safetensors.index.json = {"metadata": {"total_size": N}, "weight_map": {name: file}}.
// A checkpoint that fits in one shard is written as model.safetensors with no index, as
// Hugging Face does. Each shard is written atomically; the index is written last.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/io/safetensors.h"

namespace kiln::io {

inline constexpr const char* kIndexFile = "model.safetensors.index.json";

// Writes `tensors` into `dir` (created if missing) in shards of at most max_shard_bytes of
// tensor data (a larger tensor gets a shard of its own); `metadata` goes into every shard.
// Removes the other form an earlier save left in `dir` (its index when writing
// model.safetensors, its model.safetensors when writing shards), which would shadow this one.
// Returns the files written (shards, then the index when there is one).
std::vector<std::string> save_sharded(const std::string& dir, const TensorMap& tensors, uint64_t max_shard_bytes,
                                      const Metadata& metadata = {});
std::vector<std::string> save_sharded(const std::string& dir, const StoredTensors& tensors, uint64_t max_shard_bytes,
                                      const Metadata& metadata = {});

// Whether save_sharded writes or removes files of this name: model.safetensors, the index,
// model-NNNNN-of-NNNNN.safetensors.
bool is_sharded_file_name(const std::string& name);

struct ShardIndex {
  std::string dir;                                          // folder of the index
  std::vector<std::pair<std::string, std::string>> weight_map;  // name → shard file, sorted by name
  std::vector<std::string> shards;                          // distinct shard files, sorted
  int64_t total_size = -1;                                  // metadata.total_size (-1 when absent)
};
// Parses and checks an index (shard names must be plain file names in the same folder).
ShardIndex read_shard_index(const std::string& index_path);
// The checkpoint file to read in a folder: its index, model.safetensors, or its only
// *.safetensors / pytorch_model.bin; kiln::Error otherwise.
std::string checkpoint_in_folder(const std::string& dir);

}  // namespace kiln::io
