// check_index_range: the range check of index tensors (embedding ids, cross-entropy targets).
// On CPU it fails at once; on CUDA it does not synchronise the host: the failure is raised at
// the next device-to-host copy (item(), to(kCPU)) or synchronize() (kernels::cuda::defer_range_check).
// The message is "<what>[pos]=value<tail>", pos the first bad position (of the flattened ids).
// not_ignored: the f64 mask of the targets that are not ignore_index (the mean's divisor of
// cross_entropy and linear_cross_entropy), exact for any int64 ignore_index.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::detail {

// ids: contiguous i64/i32. Valid: lo <= id < hi, or id == ignore.
void check_index_range(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore, const std::string& what,
                       const std::string& tail);

// CUDA graphs (train/step_graph.h): the deferred checks a capture queued (from `mark` on), to be
// queued again before each replay at the positions the captured kernels write (kernels/nn.h).
// Nothing to do on the CPU, whose checks fail at once.
struct DeferredChecks {
  size_t mark = 0;
  std::vector<std::pair<std::string, std::string>> checks;  // what, tail
};
size_t deferred_check_count(Device device);
DeferredChecks deferred_checks_since(Device device, size_t mark);
void requeue_deferred_checks(Device device, const DeferredChecks& c);

// ids: i64/i32, any shape. 1.0 where id != ignore, else 0.0 (f64, on ids' device, no host sync).
// The comparison is exact as an integer (through a double, an ignore past 2^53 would round onto
// its neighbours); an ignore an i32 id cannot hold equals no id. Defined in ops/loss.cpp.
Tensor not_ignored(const Tensor& ids, int64_t ignore);

}  // namespace kiln::detail
