// CPU-only build: kiln's GEMM front door (gemm.h) says "built without CUDA".
#include "kiln/kernels/cuda/gemm/gemm.h"

namespace kiln::kernels::gemm {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  fail(what, ": kiln was built without CUDA (configure with the 'cuda' preset)");
}
}  // namespace

void gemm(const GemmProblem&, const EpilogueArgs&, const GemmOptions&) { no_cuda("gemm"); }
bool kiln_supported(const GemmProblem&, const EpilogueArgs&, std::string* why) {
  if (why) *why = "kiln was built without CUDA";
  return false;
}
bool kiln_stores_by_tma(const GemmProblem&, const EpilogueArgs&, const GemmOptions&) { return false; }
Backend chosen_backend(const GemmProblem&, const EpilogueArgs&, const GemmOptions&) { no_cuda("gemm"); }
void combine_row_stats(const Tensor&, const Tensor&, Epilogue) { no_cuda("combine_row_stats"); }

}  // namespace kiln::kernels::gemm
