// check_inplace: the guard every in-place op calls first. Refuses leaves that require grad
// (and tensors in a graph) while grad mode is on, then bumps the version counter so backward
// can detect the write. check_inplace_source: the guard for an in-place op's source.
#pragma once
#include "kiln/core/tensor.h"

namespace kiln {
void check_inplace(const Tensor& t, const char* op);
// In-place ops record no autograd history: a source that requires grad (grad mode on) would
// lose its gradient silently (PyTorch records one), so it is an error naming `op`.
void check_inplace_source(const Tensor& src, const char* op);
}
