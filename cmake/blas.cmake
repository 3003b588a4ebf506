# Finds OpenBLAS (Debian: libopenblas-dev; Ubuntu GPU machine: system OpenBLAS) and exposes
# it as the interface target kiln_blas, with the cblas.h include directory.
find_path(KILN_CBLAS_INCLUDE cblas.h PATHS /usr/include/x86_64-linux-gnu/openblas-openmp
          /usr/include/x86_64-linux-gnu /usr/include/openblas /usr/include)
# The OpenMP build of OpenBLAS first (Debian's libopenblas-openmp-dev, what scripts/setup
# installs): it runs its threads in kiln's OpenMP pool. The pthreads build (what Debian's
# alternatives pick when both are installed) keeps its own spinning threads next to OpenMP's,
# oversubscribing the cores. The build tree's RUNPATH then points at the chosen directory.
find_library(KILN_OPENBLAS_OPENMP_LIB NAMES openblas PATHS /usr/lib/x86_64-linux-gnu/openblas-openmp NO_DEFAULT_PATH)
if(KILN_OPENBLAS_OPENMP_LIB)
  set(KILN_OPENBLAS_LIB ${KILN_OPENBLAS_OPENMP_LIB})
else()
  find_library(KILN_OPENBLAS_LIB NAMES openblas PATHS /usr/lib/x86_64-linux-gnu)
endif()
if(NOT KILN_CBLAS_INCLUDE OR NOT KILN_OPENBLAS_LIB)
  message(FATAL_ERROR "OpenBLAS not found: run scripts/setup (Debian package libopenblas-dev)")
endif()
add_library(kiln_blas INTERFACE)
target_include_directories(kiln_blas INTERFACE ${KILN_CBLAS_INCLUDE})
target_link_libraries(kiln_blas INTERFACE ${KILN_OPENBLAS_LIB})
message(STATUS "kiln: BLAS ${KILN_OPENBLAS_LIB}")
target_compile_definitions(kiln_blas INTERFACE KILN_BLAS_NAME="OpenBLAS")
