// check_inplace: the guard every in-place op calls first. Refuses leaves that require grad
// (and tensors in a graph) while grad mode is on, then bumps the version counter so backward
// can detect the write.
#pragma once
#include "kiln/core/tensor.h"

namespace kiln {
void check_inplace(const Tensor& t, const char* op);
}
