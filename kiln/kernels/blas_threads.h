// Who owns the CPU threads: kiln's OpenMP regions or OpenBLAS's own pool. An OpenBLAS built
// with pthreads (Ubuntu's default libopenblas.so.0) keeps its own threads, which fight
// OpenMP's for the cores: on the GPU machine's Xeon, 2 cores, the small preset ran 3.0-6.4 k
// tokens/s so and 9.4-9.5 k with OPENBLAS_NUM_THREADS=1 (ARCHITECTURE.md, "Build notes").
#pragma once
#include <string>

namespace kiln::kernels::cpu {

// Found through the symbols at run time (dlsym), so kiln does the right thing with whichever
// OpenBLAS the distribution installs: a pthreads OpenBLAS (openblas_get_parallel() == 1) is set
// to one thread (openblas_set_num_threads) unless OPENBLAS_NUM_THREADS or GOTO_NUM_THREADS is
// set; an OpenMP or sequential OpenBLAS, or another BLAS, is left as it is. Returns what it
// found and did, for `kiln info`. Call once, before the first BLAS call (main does).
std::string own_blas_threads();

// Whether each BLAS call runs on one thread of its own (a pthreads or sequential OpenBLAS whose
// openblas_get_num_threads() is 1: the pthreads build after own_blas_threads, or
// OPENBLAS_NUM_THREADS=1): the CPU GEMM then splits a large product over kiln's OpenMP threads
// itself (kernels/cpu/matmul.cpp). Never for an OpenMP OpenBLAS, which parallelises over the
// same OpenMP threads and whose calls from a parallel region are not known to be safe (a test that
// set it to one thread and so split hung once on CI, OpenBLAS 0.3.21).
bool blas_runs_one_thread();

}  // namespace kiln::kernels::cpu
