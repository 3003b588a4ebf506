// check_index_range: the range check of index tensors (embedding ids, cross-entropy targets).
// On CPU it fails at once; on CUDA it does not synchronise the host: the failure is raised at
// the next device-to-host copy (item(), to(kCPU)) or synchronize() (kernels::cuda::defer_range_check).
// The message is "<what>[pos]=value<tail>", pos the first bad position (of the flattened ids).
// not_ignored: the f64 mask of the targets that are not ignore_index (the mean's divisor of
// cross_entropy and linear_cross_entropy), exact for any int64 ignore_index.
#pragma once
#include <cstdint>
#include <string>

#include "kiln/core/tensor.h"

namespace kiln::detail {

// ids: contiguous i64/i32. Valid: lo <= id < hi, or id == ignore.
void check_index_range(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore, const std::string& what,
                       const std::string& tail);

// ids: i64/i32, any shape. 1.0 where id != ignore, else 0.0 (f64, on ids' device, no host sync).
// The comparison is exact as an integer (through a double, an ignore past 2^53 would round onto
// its neighbours); an ignore an i32 id cannot hold equals no id. Defined in ops/loss.cpp.
Tensor not_ignored(const Tensor& ids, int64_t ignore);

}  // namespace kiln::detail
