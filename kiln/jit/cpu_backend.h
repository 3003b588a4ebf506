// The JIT's CPU backend (docs/jit.md): generated C++ compiled by the system C++ compiler found at
// run time (KILN_CXX, else CXX, else c++ / g++ / clang++ on PATH) with -O3 -march=native -fopenmp
// into a shared object, cached on disk (kiln/jit/cache.h) and loaded with dlopen.
//
// The cache key is a SHA-256 over the generated source, the contents of every kiln header it
// includes (followed through their own includes), the flags, the target (the CPU's model and
// feature flags, as -march=native reads them), the compiler's path and version and kiln's
// version. A source that does not compile gives a kiln::Error carrying the compiler's messages
// about the user's code (the lines of the files named in user_files, which the generated source
// marks with #line), and nothing is cached.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/jit/compile_service.h"

namespace kiln::jit {

struct CompileRequest {
  std::string name;                     // what compiles (progress lines, messages)
  std::string source;                   // the translation unit
  std::vector<std::string> user_files;  // #line names of user code ("score_mod", "mask_mod")
  // NVRTC only: name expressions of the kernels to instantiate and name
  // ("&ns::kernel<T, 128, Mod>"); Cubin::lowered_names gives their symbols, in this order.
  std::vector<std::string> name_expressions = {};
};

struct CpuCompiler {
  std::string path;     // absolute
  std::string version;  // the first line of --version
};
// The compiler as above, or nullopt when there is none.
std::optional<CpuCompiler> find_cpu_compiler();
// The folder holding kiln/ (the headers a generated source includes): KILN_INCLUDE_DIR, else
// the source tree this kiln was built from.
std::string include_root();
// "path\ncontents\n" of every kiln header `source` includes, transitively, in a fixed order.
std::string kiln_headers_of(const std::string& source, const std::string& root);
// The flags of a CPU kernel (without the output and input paths).
std::vector<std::string> cpu_flags(const std::string& root);
// The target as the key records it: the CPU's model name and feature flags.
std::string cpu_target();
// The key's fields, by name, in the order they are hashed (tests check that each one matters).
struct KeyFields {
  std::vector<std::pair<std::string, std::string>> fields;
  std::string digest() const;
};
KeyFields cpu_key_fields(const CompileRequest& r, const CpuCompiler& cxx);

struct LoadedModule {
  std::shared_ptr<void> handle;  // dlclose'd with the last reference
  std::string path;
  std::string key;
  bool from_cache = false;
};
// Compiles `r` (or loads it from the cache) and loads it. Errors: no compiler (saying how to name
// one), a compile error (the compiler's messages about the user's code), a load error.
LoadedModule compile_cpu(const CompileRequest& r, const CancelToken* token = nullptr);
// The address of an exported symbol (an error naming it when it is missing).
void* module_symbol(const LoadedModule& m, const char* name);

}  // namespace kiln::jit
