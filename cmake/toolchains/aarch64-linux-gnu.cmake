# Cross build for aarch64 Linux with Debian's cross toolchain (g++-aarch64-linux-gnu) and the
# arm64 libraries of Debian multiarch (libopenblas-openmp-dev:arm64); `scripts/setup --aarch64`
# installs both. The programs it builds run here through qemu-user: CMAKE_CROSSCOMPILING_EMULATOR
# is cmake/toolchains/qemu-aarch64, which runs qemu-aarch64-static with an explicit -cpu
# (KILN_QEMU_CPU, default max,sve128=on; plain max would run 512-bit SVE) and this sysroot's -L.
# SentencePiece is left out: its arm64 package cannot sit beside the amd64 one (docs/arm.md).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# The cross toolchain's own sysroot (libc, libstdc++, libgomp) and Debian's multiarch folders.
set(KILN_AARCH64_SYSROOT /usr/aarch64-linux-gnu CACHE PATH "sysroot of the aarch64 cross toolchain (qemu's -L)")
set(CMAKE_FIND_ROOT_PATH ${KILN_AARCH64_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# Link-time lookups of the libraries OpenBLAS itself needs (libgfortran, libgomp).
set(CMAKE_EXE_LINKER_FLAGS_INIT "-Wl,-rpath-link,/usr/lib/aarch64-linux-gnu")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "-Wl,-rpath-link,/usr/lib/aarch64-linux-gnu")

# pkg-config sees only arm64 packages (the amd64 sentencepiece.pc must not be picked up).
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)
set(ENV{PKG_CONFIG_PATH} "")

# OpenBLAS for arm64, the OpenMP build as on x86 (cmake/blas.cmake would look in x86_64 folders).
set(KILN_OPENBLAS_OPENMP_LIB /usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so CACHE FILEPATH "")
set(KILN_CBLAS_INCLUDE /usr/include/aarch64-linux-gnu/openblas-openmp CACHE PATH "")
# GoogleTest from Debian's sources (googletest package), never the amd64 libgtest-dev.
set(CMAKE_DISABLE_FIND_PACKAGE_GTest ON)
set(KILN_GTEST_SOURCE_DIR /usr/src/googletest CACHE PATH "")

set(CMAKE_CROSSCOMPILING_EMULATOR ${CMAKE_CURRENT_LIST_DIR}/qemu-aarch64)
