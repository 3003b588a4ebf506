// The process-wide switches of kiln's runtime, read by kernels of every device and set by the
// trainer, the CLI and tests (the runtime layer of core: nothing above core is needed to read
// them). Both are process-wide like torch.use_deterministic_algorithms and
// torch.utils.deterministic.fill_uninitialized_memory: a kernel reads them at launch, whichever
// thread launches it.
#pragma once
#include <cstdint>

#include "kiln/core/dtype.h"

namespace kiln {

// Determinism: when on, every kernel is bitwise reproducible run to run (fixed reduction
// orders, fixed thread partitions, no float atomics, no split-K GEMM reductions). Off by default.
bool deterministic();
void set_deterministic(bool on);

// Poison fill (a debugging switch): while on, every tensor Tensor::empty makes starts filled
// with a poison value (floating dtypes NaN, integers 0x7F in every byte, bool true), so that an
// output element a kernel forgets to write shows in its result instead of whatever the memory
// held before. Off by default; its first value comes from the environment
// (KILN_FILL_UNINITIALIZED=1 turns it on: the test suite runs that way, see CMakeLists.txt).
bool fill_uninitialized_memory();
void set_fill_uninitialized_memory(bool on);
// The byte Tensor::empty fills a tensor of `dtype` with while the poison fill is on.
uint8_t uninitialized_fill_byte(DType dtype);

}  // namespace kiln
