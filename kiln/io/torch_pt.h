// PyTorch zip checkpoints (torch.save since 1.6): <prefix>/data.pkl unpickled by the restricted
// unpickler with an allow-list of globals, storages read zero-copy from <prefix>/data/<key>.
// Nested dicts/lists are flattened with dots ("model.layers.0.w"); non-tensor leaves (ints,
// strings, None: epoch counters, config) are skipped. Views keep their storage offset and
// strides (tensors sharing a storage share it here too).
#pragma once
#include <string>
#include <vector>

#include "kiln/io/safetensors.h"

namespace kiln::io {

// The globals a checkpoint may name (everything else is a kiln::Error naming the global).
const std::vector<std::string>& torch_allowed_globals();

TensorMap load_torch_zip(const std::string& path);

}  // namespace kiln::io
