// Shared by the JIT tests: one disk cache for the whole test run (under the test binary's
// folder, so a kernel compiled by one test process is reused by the next where the test is not
// about the cache), a fresh private folder for the cache tests, and a scoped environment variable.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace kiln::test {

inline std::string test_binary_dir() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
}

// Points KILN_CACHE_DIR at the run's shared cache (created owner-only) unless the caller set one.
inline void use_shared_jit_cache() {
  static const bool once = [] {
    if (!std::getenv("KILN_CACHE_DIR")) {
      const std::string dir = test_binary_dir() + "/jit-test-cache";
      std::filesystem::create_directories(dir);
      std::filesystem::permissions(dir, std::filesystem::perms::owner_all, std::filesystem::perm_options::replace);
      ::setenv("KILN_CACHE_DIR", dir.c_str(), 1);
    }
    return true;
  }();
  (void)once;
}

// A fresh empty folder (mkdtemp under /tmp), removed by the destructor.
struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/kiln-jit-test-XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path, std::filesystem::perms::owner_all, std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path, ec);
  }
};

// Sets an environment variable for a scope, restoring it after.
struct ScopedEnv {
  std::string name;
  bool had = false;
  std::string old;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (const char* o = std::getenv(n)) had = true, old = o;
    if (value) ::setenv(n, value, 1);
    else ::unsetenv(n);
  }
  ~ScopedEnv() {
    if (had) ::setenv(name.c_str(), old.c_str(), 1);
    else ::unsetenv(name.c_str());
  }
};

}  // namespace kiln::test
