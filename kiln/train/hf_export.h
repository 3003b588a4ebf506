// Consolidation of a kiln checkpoint into the Hugging Face layout that transformers'
// LlamaForCausalLM.from_pretrained loads (`kiln convert RUN_DIR OUT_DIR --hf`): config.json
// and model.safetensors under Hugging Face names, plus the tokenizer's files when the checkpoint
// has them, written by save_checkpoint (checkpoint.h, the one-process writer) as a model-only
// checkpoint. The input is a sharded checkpoint of any world size (parallel/dcp.h: each
// parameter's chunks read from every rank's file) or a one-process one (model.safetensors or a
// Hugging Face sharded index); the optimizer state is left out.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "kiln/nn/llama.h"
#include "kiln/train/checkpoint.h"

namespace kiln::train {

// The model of checkpoint folder `dir` (sharded or one-process) whole, in one process: every
// parameter from its chunks, checked before anything is read (parallel::load_sharded); a tensor
// that is neither a parameter of config.json's model nor an optimizer buffer of one is an error.
std::unique_ptr<nn::LlamaForCausalLM> load_consolidated(const std::string& dir, Device device = kCPU);

struct HfExportOptions {
  int64_t step = -1;   // >= 0: IN/step-N; else IN's `latest` (or IN itself when it is a checkpoint)
  bool force = false;  // replace a non-empty OUT (as a whole, once the new one is complete)
  WriteHook hook;      // after each file is written (tests inject failures)
};

struct HfExportResult {
  std::string checkpoint;  // the folder read
  std::string note;        // find_checkpoint's note (a damaged `latest`), or ""
  bool sharded = false;    // a sharded checkpoint (sharded.index.json)
  int64_t world_size = 1;  // the ranks that wrote it
  int64_t parameters = 0;  // elements
  bool tokenizer = false;  // its files were carried over
};

// Writes OUT as a Hugging Face checkpoint of IN's checkpoint. OUT is written as a temporary
// sibling and renamed into place: a failure leaves OUT as it was. kiln::Error when there is no
// checkpoint, when OUT is a file, non-empty without `force`, or the checkpoint (or a folder
// holding it), and for every damage load_consolidated finds (naming the file and the tensor).
HfExportResult export_hf(const std::string& in, const std::string& out, const HfExportOptions& options = {});

}  // namespace kiln::train
