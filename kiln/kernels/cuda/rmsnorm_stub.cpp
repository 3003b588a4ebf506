// CPU-only build: the fast CUDA RMSNorm kernels (rmsnorm.h) decline everything; rms_norm_add
// says "built without CUDA".
#include "kiln/kernels/cuda/rmsnorm.h"

namespace kiln::kernels::cuda::rmsnorm {

bool applies(DType, int64_t) { return false; }
bool forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) { return false; }
bool backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  return false;
}
void add_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) {
  fail("rms_norm_add: kiln was built without CUDA (configure with the 'cuda' preset)");
}

}  // namespace kiln::kernels::cuda::rmsnorm
