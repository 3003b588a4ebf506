// The JIT's CUDA backend (docs/jit.md): NVRTC and the CUDA driver API opened at run time with
// dlopen, so that a CPU-only build and a machine without a GPU still run (nvrtc() / driver()
// return null there, and callers say so). Sources are compiled for sm_90a to a cubin, cached on
// disk like the CPU kernels (the key: source, kiln headers, options, arch, NVRTC's version,
// kiln's version), and loaded with cuLibraryLoadData / cuLibraryGetKernel / cuKernelGetFunction.
// The generated sources include only device-only headers (kernels/device_std.h).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/stream.h"
#include "kiln/jit/cpu_backend.h"

namespace kiln::jit {

// NVRTC's entry points (nvrtc.h's signatures with opaque handles).
struct NvrtcApi {
  int (*version)(int*, int*);
  int (*create)(void** prog, const char* src, const char* name, int n, const char* const* headers,
                const char* const* include_names);
  int (*compile)(void* prog, int n, const char* const* options);
  int (*log_size)(void* prog, size_t*);
  int (*log)(void* prog, char*);
  int (*cubin_size)(void* prog, size_t*);
  int (*cubin)(void* prog, char*);
  int (*destroy)(void** prog);
  int (*add_name_expression)(void* prog, const char* expr);
  int (*lowered_name)(void* prog, const char* expr, const char** lowered);
  std::string version_string;  // "13.0"
};
// The driver's entry points used to load and launch (cuda.h's signatures with opaque handles).
struct DriverApi {
  int (*init)(unsigned);
  int (*library_load_data)(void** lib, const void* image, void* jit_opts, void** jit_vals, unsigned n_jit,
                           void* lib_opts, void** lib_vals, unsigned n_lib);
  int (*library_get_kernel)(void** kernel, void* lib, const char* name);
  int (*kernel_get_function)(void** fn, void* kernel);
  int (*library_unload)(void* lib);
  int (*launch)(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                unsigned smem, void* stream, void** params, void** extra);
  int (*get_error_string)(int, const char**);
  int (*func_set_attribute)(void* fn, int attribute, int value);
  int (*ctx_get_current)(void** ctx);
  int (*primary_ctx_retain)(void** ctx, int device);
  int (*ctx_set_current)(void* ctx);
};

// libnvrtc (KILN_NVRTC, else libnvrtc.so / .so.13 / .so.12 on the loader's path, else under
// $CUDA_HOME or /usr/local/cuda), or null with the reason in *why.
const NvrtcApi* nvrtc(std::string* why = nullptr);
// libcuda.so.1 with cuInit(0) done, or null with the reason (no driver, no GPU).
const DriverApi* driver(std::string* why = nullptr);
// The CUDA toolkit's include folder (cuda_bf16.h, cuda_fp16.h): KILN_CUDA_INCLUDE, else
// $CUDA_HOME/include, else /usr/local/cuda/include; "" when none exists.
std::string cuda_include_dir();
// NVRTC's options for a kernel (-arch, -std, include folders).
std::vector<std::string> nvrtc_flags(const std::string& arch);

struct Cubin {
  std::string image;
  std::string key;
  bool from_cache = false;
  std::vector<std::string> lowered_names;  // of CompileRequest::name_expressions, in order
};
// Compiles `r` with NVRTC for `arch` (or loads it from the cache: the cubin and, with name
// expressions, their lowered names beside it). Errors: no NVRTC (saying how to name one), a
// compile error (NVRTC's log about the user's code, nothing cached).
Cubin compile_cuda(const CompileRequest& r, const std::string& arch = "sm_90a", const CancelToken* token = nullptr);

struct CudaFunction {
  std::shared_ptr<void> library;  // cuLibraryUnload'ed with the last reference
  void* function = nullptr;       // a CUfunction
};
// Loads a cubin in the current context and finds an extern "C" kernel in it.
CudaFunction load_cuda_function(const Cubin& cubin, const char* name);
// The same for several kernels of one cubin (one library).
struct CudaFunctions {
  std::shared_ptr<void> library;
  std::vector<void*> functions;
};
CudaFunctions load_cuda_functions(const Cubin& cubin, const std::vector<std::string>& names);
// Launches `fn` (args: pointers to each argument's bytes) on `stream` (a CUDA stream of
// kiln/core/stream.h: the caller passes current_stream(device), where kiln's own kernels and the
// allocator's stream-ordered blocks are), with no synchronisation: the launch is ordered after the
// work on that stream and before what follows on it, as any kiln kernel. A launch error names
// `what`; a fault inside the kernel surfaces at the stream's next synchronisation, as for kiln's
// own kernels.
// `smem`: dynamic shared memory in bytes (beyond 48 KB, allow_dynamic_smem first).
void launch_cuda(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned block, void** args, const Stream& stream,
                 const char* what, unsigned smem = 0);
// Lets `fn` take `bytes` of dynamic shared memory (cuFuncSetAttribute's
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES); an error names `what`.
void allow_dynamic_smem(void* fn, int bytes, const char* what);

}  // namespace kiln::jit
