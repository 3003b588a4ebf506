// The JIT's on-disk cache (docs/jit.md, "The cache"): compiled kernels keyed by a SHA-256 over
// everything that shapes them (kiln/jit/compile.h builds the key). A cached kernel is code that
// kiln will run, so the folder must be the user's own: it is created owner-only (0700) and
// refused, with a message, when another user owns it or others can write to it.
//
// An entry is two files: <key>.<ext> (the shared object or cubin) and <key>.meta, which names
// the key, the payload's size and its SHA-256. Each is written to a temporary file and renamed
// into place, the meta last, so a concurrent reader sees a whole entry or none. An entry whose
// meta or payload does not check (truncated, foreign, corrupt) is ignored with a warning,
// removed and rebuilt.
#pragma once
#include <optional>
#include <string>
#include <string_view>

namespace kiln::jit {

// The cache folder: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln; created
// (with its parents) when missing, checked as above; an error says what is wrong and what to do.
std::string cache_dir();
// The checks alone, on an existing folder (tests): an error when it is not a folder, another
// user owns it, or group / others can write to it.
void check_cache_dir(const std::string& dir);

class DiskCache {
 public:
  explicit DiskCache(std::string dir);  // entries live in dir/jit
  const std::string& dir() const { return dir_; }
  // The payload's path when a valid entry for `key` exists.
  std::optional<std::string> lookup(const std::string& key, const std::string& ext) const;
  // Stores a payload under `key` (atomically, as above) and returns its path.
  std::string store(const std::string& key, const std::string& ext, std::string_view payload) const;
  // A fresh private scratch folder under the cache for one compilation (removed by the caller).
  std::string scratch_dir() const;

 private:
  std::string dir_;
};

// Reads a whole file (an error naming it when it cannot be read).
std::string read_file(const std::string& path);
// Writes `data` to path + a unique suffix, then renames it to `path`.
void write_file_atomic(const std::string& path, std::string_view data);
// Removes a scratch folder and its files.
void remove_tree(const std::string& dir);

}  // namespace kiln::jit
