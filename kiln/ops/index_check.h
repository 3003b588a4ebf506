// check_index_range: the range check of index tensors (embedding ids, cross-entropy targets).
// On CPU it fails at once; on CUDA it does not synchronise the host: the failure is raised at
// the next device-to-host copy (item(), to(kCPU)) or synchronize() (kernels::cuda::defer_range_check).
// The message is "<what>[pos]=value<tail>", pos the first bad position (of the flattened ids).
#pragma once
#include <cstdint>
#include <string>

#include "kiln/core/tensor.h"

namespace kiln::detail {

// ids: contiguous i64/i32. Valid: lo <= id < hi, or id == ignore.
void check_index_range(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore, const std::string& what,
                       const std::string& tail);

}  // namespace kiln::detail
