// The one place kiln configures the BLAS library it calls (OpenBLAS): before the first GEMM,
// a pthreads build of OpenBLAS is given the OpenMP thread count. Otherwise it starts one thread
// per core of the machine, even when the process is pinned to fewer cores or asked for fewer
// threads (OMP_NUM_THREADS), and those threads spin next to OpenMP's: measured on a 16-core
// Xeon pinned to 2 cores, kiln's training ran ~6× slower than PyTorch's with the same threads.
// The OpenMP build already runs in kiln's OpenMP pool and is left alone.
#pragma once

namespace kiln::kernels::cpu {

// Idempotent and thread-safe; cheap after the first call.
void blas_init_threads();

}  // namespace kiln::kernels::cpu
