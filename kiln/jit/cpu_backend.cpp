// The CPU backend: finding the compiler, the cache key, compiling, loading.
#include "kiln/jit/cpu_backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/jit/cache.h"
#include "kiln/jit/sha256.h"

namespace kiln::jit {
namespace fs = std::filesystem;

namespace {
std::optional<std::string> on_path(const std::string& name) {
  if (name.find('/') != std::string::npos) return access(name.c_str(), X_OK) == 0 ? std::optional(name) : std::nullopt;
  const char* path = std::getenv("PATH");
  std::stringstream s(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(s, dir, ':');) {
    const std::string p = (dir.empty() ? "." : dir) + "/" + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return std::nullopt;
}

// The compiler's messages about the user's code: the lines that name a user file, with the
// source lines and carets that follow them; all of it (bounded) when none does.
std::string user_messages(const std::string& out, const std::vector<std::string>& user_files) {
  std::stringstream s(out);
  std::string kept, line;
  bool keep = false;
  while (std::getline(s, line)) {
    bool names_user = false;
    for (const auto& f : user_files)
      if (line.rfind(f + ":", 0) == 0) names_user = true;
    const bool context = line.rfind(" ", 0) == 0 || line.rfind("\t", 0) == 0;
    if (names_user) keep = true;
    else if (!context) keep = false;
    if (keep) kept += line + "\n";
  }
  if (kept.empty()) kept = out.size() > 4000 ? out.substr(0, 4000) + "\n..." : out;
  return kept;
}
}  // namespace

std::optional<CpuCompiler> find_cpu_compiler() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::vector<std::string> names;
  for (const char* env : {"KILN_CXX", "CXX"})
    if (const char* v = std::getenv(env); v && *v) names.push_back(v);
  for (const char* n : {"c++", "g++", "clang++"}) names.push_back(n);
  for (const auto& n : names) {
    auto p = on_path(n);
    if (!p) continue;
    ProcessResult r;
    try {
      r = run_process({*p, "--version"});
    } catch (const std::exception&) {
      continue;
    }
    if (r.status != 0) continue;
    return CpuCompiler{*p, r.output.substr(0, r.output.find('\n'))};
  }
  return std::nullopt;
}

std::string include_root() {
  if (const char* d = std::getenv("KILN_INCLUDE_DIR"); d && *d) return d;
  auto holds = [](const fs::path& root) {
    std::error_code ec;
    return fs::exists(root / "kiln/jit/expr_prelude.h", ec);
  };
  // This file is <root>/kiln/jit/cpu_backend.cpp in the tree kiln was built from, when the
  // build named it by an absolute path; else the nearest folder above the program that holds
  // kiln/ (a build folder inside the tree).
  const fs::path self(__FILE__);
  if (self.is_absolute() && holds(self.parent_path().parent_path().parent_path()))
    return self.parent_path().parent_path().parent_path().string();
  // Then above the binary that holds this code (the program, or a shared object such as the
  // Python module, whose wheel carries the headers in include/ beside it), then above the program.
  std::vector<fs::path> starts;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&include_root), &info) != 0 && info.dli_fname)
    starts.push_back(fs::absolute(info.dli_fname).parent_path());
  std::error_code ec;
  if (fs::path exe = fs::read_symlink("/proc/self/exe", ec); !ec) starts.push_back(exe.parent_path());
  for (const fs::path& start : starts)
    for (fs::path p = start; !p.empty(); p = p.parent_path()) {
      if (holds(p)) return p.string();
      if (holds(p / "include")) return (p / "include").string();
      if (p == p.root_path()) break;
    }
  fail("jit: cannot find kiln's headers (kiln/jit/expr_prelude.h) above this program or the library holding kiln; "
       "set KILN_INCLUDE_DIR to the folder that holds kiln/");
}

std::string kiln_headers_of(const std::string& source, const std::string& root) {
  std::set<std::string> seen;
  std::vector<std::string> todo;
  auto scan = [&](const std::string& text) {
    std::stringstream s(text);
    for (std::string line; std::getline(s, line);) {
      const size_t at = line.find("#include \"kiln/");
      if (at == std::string::npos || line.find_first_not_of(" \t") != at) continue;
      const size_t b = line.find('"') + 1, e = line.find('"', b);
      if (e == std::string::npos) continue;
      const std::string inc = line.substr(b, e - b);
      if (seen.insert(inc).second) todo.push_back(inc);
    }
  };
  scan(source);
  while (!todo.empty()) {
    const std::string inc = todo.back();
    todo.pop_back();
    std::error_code ec;
    const std::string path = root + "/" + inc;
    KILN_CHECK(fs::exists(path, ec), "jit: the kiln header '", inc, "' is not under ", root,
               " (set KILN_INCLUDE_DIR to the folder that holds kiln/)");
    scan(read_file(path));
  }
  std::string out;
  for (const auto& inc : seen) out += inc + "\n" + read_file(root + "/" + inc) + "\n";
  return out;
}

std::vector<std::string> cpu_flags(const std::string& root) {
  return {"-std=c++20", "-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared",
          "-fvisibility=hidden", "-w", "-DNDEBUG", "-I" + root};
}

std::string cpu_target() {
  std::ifstream f("/proc/cpuinfo");
  std::string model, flags;
  for (std::string line; std::getline(f, line) && (model.empty() || flags.empty());) {
    if (model.empty() && line.rfind("model name", 0) == 0) model = line;
    if (flags.empty() && (line.rfind("flags", 0) == 0 || line.rfind("Features", 0) == 0)) flags = line;
  }
  return model + "\n" + flags;
}

std::string KeyFields::digest() const {
  Sha256 h;
  for (const auto& [k, v] : fields) h.field(k, v);
  return h.hex();
}

KeyFields cpu_key_fields(const CompileRequest& r, const CpuCompiler& cxx) {
  const std::string root = include_root();
  std::string flags;
  for (const auto& f : cpu_flags(root)) flags += f + " ";
  return KeyFields{{{"backend", "cpu"},
                    {"source", r.source},
                    {"headers", kiln_headers_of(r.source, root)},
                    {"options", flags},
                    {"target", cpu_target()},
                    {"compiler", cxx.path + "\n" + cxx.version},
                    {"kiln", KILN_VERSION}}};
}

namespace {
LoadedModule load(const std::string& path, const std::string& key, bool from_cache) {
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  KILN_CHECK(h != nullptr, "jit: cannot load the compiled kernel '", path, "': ", ::dlerror(),
             " (a cache on a noexec filesystem cannot hold kernels: set KILN_CACHE_DIR)");
  return LoadedModule{std::shared_ptr<void>(h, [](void* p) { ::dlclose(p); }), path, key, from_cache};
}
}  // namespace

LoadedModule compile_cpu(const CompileRequest& r, const CancelToken* token) {
  const auto cxx = find_cpu_compiler();
  KILN_CHECK(cxx.has_value(), "jit: ", r.name, " needs a C++ compiler and none was found (looked for $KILN_CXX, "
                              "$CXX, c++, g++ and clang++ on PATH); install g++ or name one with KILN_CXX. The "
                              "built-in mods need no compiler.");
  const std::string key = cpu_key_fields(r, *cxx).digest();
  DiskCache cache(cache_dir());
  if (auto hit = cache.lookup(key, "so")) return load(*hit, key, true);
  const std::string scratch = cache.scratch_dir();
  struct Cleanup {
    std::string dir;
    ~Cleanup() { remove_tree(dir); }
  } cleanup{scratch};
  const std::string src = scratch + "/kernel.cpp", out = scratch + "/kernel.so";
  write_file_atomic(src, r.source);
  std::vector<std::string> argv{cxx->path};
  for (auto& f : cpu_flags(include_root())) argv.push_back(f);
  argv.insert(argv.end(), {src, "-o", out});
  const ProcessResult res = run_process(argv, token);
  if (res.status != 0)
    fail("jit: ", r.name, " does not compile:\n", user_messages(res.output, r.user_files));
  const std::string path = cache.store(key, "so", read_file(out));
  return load(path, key, false);
}

void* module_symbol(const LoadedModule& m, const char* name) {
  void* s = ::dlsym(m.handle.get(), name);
  KILN_CHECK(s != nullptr, "jit: the compiled kernel '", m.path, "' has no symbol ", name);
  return s;
}

}  // namespace kiln::jit
