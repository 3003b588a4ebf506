// BLAS thread configuration (kiln/kernels/cpu/blas.h).
#include "kiln/kernels/cpu/blas.h"

#include <cblas.h>
#include <omp.h>

#include <mutex>

namespace kiln::kernels::cpu {

void blas_init_threads() {
  // Process-wide by nature: OpenBLAS's thread count is a property of the loaded library.
  static std::once_flag once;
  std::call_once(once, [] {
    if (openblas_get_parallel() == 1) openblas_set_num_threads(omp_get_max_threads());  // 1: pthreads build
  });
}

}  // namespace kiln::kernels::cpu
