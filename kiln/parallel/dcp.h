// Sharded (distributed) checkpoints, after torch.distributed.checkpoint: every rank writes the
// rows it holds of each tensor (parameters and optimizer state) as one safetensors file, and
// rank 0 writes one index, sharded.index.json:
//
//   {"format": "kiln.sharded", "version": 1, "world_size": N, "metadata": {...},
//    "tensors": {NAME: {"shape": [global], "dtype": "F32",
//                       "chunks": [{"offset": [row, 0, ...], "shape": [rows, ...],
//                                   "file": "shard-00001-of-00002.safetensors",
//                                   "bytes": [first, end]}, ...]}}}
//
// Offsets are global (the chunk's first element in the whole tensor), bytes are positions in
// the file; padding is never stored, a rank holding no rows of a tensor stores no chunk. The
// folder is written as `DIR.tmp-sharded`, each file fsynced, a barrier, then rank 0 renames it
// into place (an existing DIR is replaced only then) and a second barrier: a crash leaves the
// previous checkpoint whole.
//
// Loading reads the chunks that intersect the rows this rank holds now, so a checkpoint loads
// at any world size; a folder without an index but with model.safetensors (and
// optimizer.safetensors, trainer_state.json's "optimizer") — kiln train's single-process
// checkpoint — loads the same way, each tensor one whole chunk. Everything is checked before
// anything is written (a missing tensor, chunks that leave rows uncovered or overlap, a file
// missing, cut short or disagreeing with the index: kiln::Error naming the file and the
// tensor), so a failed load leaves the parameters and the optimizer as they were.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "kiln/dist/communicator.h"
#include "kiln/io/json.h"
#include "kiln/optim/optimizer.h"
#include "kiln/parallel/fsdp.h"

namespace kiln::parallel {

inline constexpr const char* kShardedIndexFile = "sharded.index.json";

// Rows [row_begin, row_begin + local.size(0)) of a tensor of `global_shape` named `name`.
struct ShardedTensor {
  std::string name;
  Shape global_shape;
  int64_t row_begin = 0;
  Tensor local;  // contiguous; on load, filled in place
};

// Writes `tensors` (this rank's) into the checkpoint folder `dir`, collectively over `comm`.
// `metadata` (rank 0's) goes into the index; `rank0_files(tmp)` lets rank 0 add files (a
// config.json, trainer state) to the temporary folder before it is renamed.
void save_sharded(const std::string& dir, dist::Communicator& comm, const std::vector<ShardedTensor>& tensors,
                  const json::Value& metadata = json::Value::object(),
                  const std::function<void(const std::string& tmp)>& rank0_files = nullptr);

// Fills every target's rows from the checkpoint `dir` (local only, no communication); returns
// the index's metadata (for a single-process checkpoint: {"optimizer": trainer_state.json's}).
json::Value load_sharded(const std::string& dir, std::vector<ShardedTensor>& targets);

// The names, global shapes and dtypes of a checkpoint's tensors (index or single-process).
struct CheckpointEntry {
  std::string name;
  Shape shape;
  std::string dtype;
};
std::vector<CheckpointEntry> checkpoint_entries(const std::string& dir);

// The FSDP model's shards and the optimizer's state on them: save_sharded of the parameters and
// every optimizer buffer ("exp_avg.<name>", as Optimizer::state_dict names them), with the
// optimizer's scalars as metadata "optimizer".
void save_checkpoint(const std::string& dir, const FsdpModule& fsdp, const optim::Optimizer& opt,
                     const std::function<void(const std::string& tmp)>& rank0_files = nullptr);
// Loads parameters and optimizer state (at any world size; from a single-process checkpoint too).
void load_checkpoint(const std::string& dir, FsdpModule& fsdp, optim::Optimizer& opt);
// Parameters only (a model-only checkpoint, or to evaluate).
void load_model(const std::string& dir, FsdpModule& fsdp);

// Every tensor of a checkpoint, whole (f32 as stored): consolidates a sharded checkpoint for a
// single process (kiln train's load_model_state / Hugging Face layout).
std::vector<std::pair<std::string, Tensor>> load_full(const std::string& dir);

}  // namespace kiln::parallel
