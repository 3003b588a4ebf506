// Refuse before the out-of-memory killer: an estimate of what a training run holds at once
// (parameters, gradients, AdamW state, a micro-batch's activations and logits, the step's
// batches), compared with the memory the device has available before the model is built.
// The estimate is a lower bound (it leaves out the allocator's slack and temporaries), so a
// run it refuses cannot fit; one it passes may still be tight.
#pragma once
#include <cstdint>
#include <string>

#include "kiln/core/device.h"
#include "kiln/nn/llama.h"
#include "kiln/train/config.h"

namespace kiln::train {

struct MemoryEstimate {
  int64_t parameters = 0, gradients = 0, optimizer = 0, activations = 0, batches = 0;
  int64_t total() const { return parameters + gradients + optimizer + activations + batches; }
};

// For `cfg` with the model `model` (bf16: the forward's bf16 copies of the weights too).
MemoryEstimate estimate_training_memory(const TrainConfig& cfg, const nn::LlamaConfig& model, bool bf16);

// Bytes `dev` can still take, and where the figure comes from: on the CPU MemAvailable plus
// SwapFree (/proc/meminfo), or the cgroup's memory.max less memory.current when that is less;
// on CUDA the device's total less used (NVML). -1 when the platform cannot say.
struct AvailableMemory {
  int64_t bytes = -1;
  std::string source;
};
AvailableMemory available_memory(const Device& dev, const std::string& proc_root = "/");

// kiln::Error when the estimate exceeds what is available: the message gives both, each part
// of the estimate with the flags that set it, and the flags to change. Nothing when the
// available memory is unknown.
void check_memory_fits(const TrainConfig& cfg, const nn::LlamaConfig& model, bool bf16, const Device& dev,
                       const AvailableMemory& available);

}  // namespace kiln::train
