// Build without CUDA: the CUDA-only kernel entry points that front ends call directly (not
// through KILN_DEVICE_CALL, because the CPU has no counterpart): each throws kiln::Error naming
// itself and the missing CUDA build. No tensor lives on a GPU in such a build
// (check_device_available refuses), so reaching one is a bug of the caller, said clearly.
#include <string>

#include "kiln/core/error.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/flex_files.h"
#include "kiln/kernels/lce.h"
#include "kiln/kernels/nn.h"

namespace kiln::kernels::cuda {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  fail(what, ": kiln was built without CUDA (configure with the 'cuda' preset)");
}
}  // namespace

void copy_host_to_device(void*, const void*, size_t, int) { no_cuda("copy_host_to_device"); }
void copy_device_to_host(void*, const void*, size_t, int) { no_cuda("copy_device_to_host"); }
void copy_device_to_device(void*, int, const void*, int, size_t) { no_cuda("copy_device_to_device"); }
void defer_range_check(const Tensor&, int64_t, int64_t, int64_t, const std::string&, const std::string&) {
  no_cuda("defer_range_check");
}
void synchronize_and_check(int) { no_cuda("synchronize_and_check"); }
size_t deferred_check_count(int) { return 0; }
std::vector<std::pair<std::string, std::string>> deferred_checks_since(int, size_t) { return {}; }
void requeue_deferred_checks(int, size_t, const std::vector<std::pair<std::string, std::string>>& checks) {
  if (!checks.empty()) no_cuda("requeue_deferred_checks");
}
void lce_scale(const Tensor&, const Tensor&) { no_cuda("lce_scale"); }
int flex_builtin_files() { return 0; }

}  // namespace kiln::kernels::cuda
