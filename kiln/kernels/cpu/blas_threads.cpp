// own_blas_threads (kernels/blas_threads.h): OpenBLAS's threading found through its symbols.
#include "kiln/kernels/blas_threads.h"

#include <dlfcn.h>

#include <cstdlib>

namespace kiln::kernels::cpu {

std::string own_blas_threads() {
  using GetParallel = int (*)();
  using SetThreads = void (*)(int);
  auto get_parallel = reinterpret_cast<GetParallel>(::dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  auto set_threads = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!get_parallel) return "not OpenBLAS (threads left to the BLAS)";
  const int kind = get_parallel();  // 0 sequential, 1 pthreads, 2 OpenMP
  if (kind != 1) return kind == 2 ? "OpenBLAS (OpenMP): shares kiln's OpenMP threads" : "OpenBLAS (sequential)";
  if (std::getenv("OPENBLAS_NUM_THREADS") || std::getenv("GOTO_NUM_THREADS"))
    return "OpenBLAS (pthreads): its thread count as OPENBLAS_NUM_THREADS sets it";
  if (!set_threads) return "OpenBLAS (pthreads): no openblas_set_num_threads, left as it is";
  set_threads(1);  // kiln's OpenMP regions own the cores; each GEMM runs on the thread that calls it
  return "OpenBLAS (pthreads): set to 1 thread, kiln's OpenMP threads own the cores";
}

bool blas_runs_one_thread() {
  using GetInt = int (*)();
  static const GetInt get_parallel = reinterpret_cast<GetInt>(::dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  static const GetInt get_threads = reinterpret_cast<GetInt>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  // An OpenMP OpenBLAS (2) already runs on kiln's OpenMP threads.
  return get_parallel && get_parallel() != 2 && get_threads && get_threads() == 1;
}

}  // namespace kiln::kernels::cpu
