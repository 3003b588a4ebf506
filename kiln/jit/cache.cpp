// The JIT's on-disk cache: folder checks, entries written atomically and verified on read.
#include "kiln/jit/cache.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/jit/sha256.h"

namespace kiln::jit {
namespace fs = std::filesystem;

namespace {
std::string home_dir() {
  const char* h = std::getenv("HOME");
  if (h && *h) return h;
  const passwd* pw = getpwuid(getuid());
  KILN_CHECK(pw && pw->pw_dir, "jit cache: no HOME and no home folder for uid ", getuid(),
             " (set KILN_CACHE_DIR)");
  return pw->pw_dir;
}

void make_private_dirs(const std::string& dir) {
  std::error_code ec;
  fs::path p(dir);
  if (!fs::exists(p, ec)) {
    if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      fail("jit cache: cannot create the cache folder '", dir, "': ", std::strerror(errno),
           " (set KILN_CACHE_DIR to a folder of your own)");
  }
}

std::string meta_text(const std::string& key, std::string_view payload) {
  std::ostringstream m;
  m << "kiln-jit-entry 1\nkey " << key << "\nsize " << payload.size() << "\nsha256 " << sha256_hex(payload) << "\n";
  return m.str();
}
}  // namespace

void check_cache_dir(const std::string& dir) {
  struct stat st {};
  KILN_CHECK(::lstat(dir.c_str(), &st) == 0, "jit cache: cannot stat '", dir, "': ", std::strerror(errno));
  KILN_CHECK(S_ISDIR(st.st_mode), "jit cache: '", dir, "' is not a folder (set KILN_CACHE_DIR to a folder of your own)");
  KILN_CHECK(st.st_uid == getuid(), "jit cache: '", dir, "' belongs to uid ", st.st_uid, ", not to you (uid ", getuid(),
             "); a cached kernel is code that kiln runs, so kiln uses only a folder of your own: set KILN_CACHE_DIR");
  KILN_CHECK((st.st_mode & (S_IWGRP | S_IWOTH)) == 0, "jit cache: '", dir, "' can be written by others (mode ",
             std::oct, (st.st_mode & 07777), std::dec,
             "); a cached kernel is code that kiln runs: chmod go-w it, or set KILN_CACHE_DIR to a private folder");
}

std::string cache_dir() {
  std::string dir;
  if (const char* d = std::getenv("KILN_CACHE_DIR"); d && *d) dir = d;
  else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) dir = std::string(x) + "/kiln";
  else dir = home_dir() + "/.cache/kiln";
  make_private_dirs(dir);
  check_cache_dir(dir);
  return dir;
}

DiskCache::DiskCache(std::string dir) : dir_(std::move(dir)) {
  make_private_dirs(dir_ + "/jit");
  check_cache_dir(dir_ + "/jit");
}

std::optional<std::string> DiskCache::lookup(const std::string& key, const std::string& ext) const {
  const std::string base = dir_ + "/jit/" + key, payload_path = base + "." + ext, meta_path = base + ".meta";
  std::error_code ec;
  if (!fs::exists(meta_path, ec)) return std::nullopt;
  std::string why;
  try {
    const std::string meta = read_file(meta_path);
    std::string payload;
    if (fs::exists(payload_path, ec)) payload = read_file(payload_path);
    else why = "its payload is missing";
    if (why.empty() && meta != meta_text(key, payload)) why = "its payload or record does not match (truncated or foreign)";
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (why.empty()) return payload_path;
  std::cerr << "kiln: warning: ignoring the cached kernel " << base << ": " << why << "; compiling it again\n";
  fs::remove(meta_path, ec);
  fs::remove(payload_path, ec);
  return std::nullopt;
}

std::string DiskCache::store(const std::string& key, const std::string& ext, std::string_view payload) const {
  const std::string base = dir_ + "/jit/" + key;
  write_file_atomic(base + "." + ext, payload);
  write_file_atomic(base + ".meta", meta_text(key, payload));
  return base + "." + ext;
}

std::string DiskCache::scratch_dir() const {
  std::string tmpl = dir_ + "/jit/tmp-XXXXXX";
  KILN_CHECK(::mkdtemp(tmpl.data()) != nullptr, "jit cache: cannot create a scratch folder in '", dir_, "/jit': ",
             std::strerror(errno));
  return tmpl;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KILN_CHECK(f.good(), "cannot read '", path, "': ", std::strerror(errno));
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_file_atomic(const std::string& path, std::string_view data) {
  static std::atomic<unsigned> serial{0};
  const std::string tmp = path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(serial++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  KILN_CHECK(fd >= 0, "cannot write '", tmp, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail("cannot write '", tmp, "': ", std::strerror(e));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    fail("cannot rename '", tmp, "' to '", path, "': ", std::strerror(e));
  }
}

void remove_tree(const std::string& dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace kiln::jit
