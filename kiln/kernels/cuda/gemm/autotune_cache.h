// The GEMM backend choices of `auto` on disk (docs/gemm.md, "Selection"): one text file,
// <cache dir>/gemm_choices.tsv, of lines
//   kiln-gemm-choices 1                                            (the header)
//   <gpu>\t<driver>\t<kiln version>\t<problem key>\t<kiln|cublaslt>\t<kiln ms>\t<cublaslt ms>
// A lookup sees only the entries of its own (gpu, driver, kiln version): a choice measured on
// another GPU, driver or kiln is ignored (and kept for that one). A file that does not parse
// (wrong header, a line without its seven fields, a bad choice or time) is ignored as a whole
// with one warning on stderr, and replaced at the next store. Stores rewrite the file through a
// temporary and a rename, so a reader sees the old file or the new one. Plain C++, header-only
// (tests run it without a GPU). The cache folder: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln,
// else ~/.cache/kiln (the JIT's rule, kiln/jit/cache.h).
#pragma once
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace kiln::kernels::gemm {

// What a measured choice is valid for.
struct MachineKey {
  std::string gpu, driver, kiln_version;
  bool operator==(const MachineKey&) const = default;
};

struct Choice {
  bool kiln = false;  // kiln's kernel (else cuBLASLt)
  double kiln_ms = 0, cublaslt_ms = 0;
};

inline std::string gemm_cache_dir_from_env() {
  if (const char* d = std::getenv("KILN_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/kiln";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/kiln";
  return "";
}

class ChoiceCache {
 public:
  static constexpr const char* kHeader = "kiln-gemm-choices 1";

  // `path` empty: a memory-only cache (no folder to write to).
  ChoiceCache(std::string path, MachineKey machine) : path_(std::move(path)), machine_(std::move(machine)) { load(); }

  const std::string& path() const { return path_; }
  // Whether the file existed but was ignored (corrupt).
  bool ignored_corrupt_file() const { return corrupt_; }

  std::optional<Choice> lookup(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find({machine_.gpu, machine_.driver, machine_.kiln_version, key});
    if (it == entries_.end()) return std::nullopt;
    return it->second;
  }

  // Records a choice and rewrites the file (failures to write are a warning: the choice stays
  // in memory for this process).
  void store(const std::string& key, const Choice& c) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_[{machine_.gpu, machine_.driver, machine_.kiln_version, key}] = c;
    if (path_.empty()) return;
    std::string why;
    if (!write_file(&why)) std::cerr << "kiln: warning: cannot write the GEMM choice cache " << path_ << ": " << why << "\n";
  }

 private:
  using Key = std::tuple<std::string, std::string, std::string, std::string>;

  static std::vector<std::string> split_tabs(const std::string& line) {
    std::vector<std::string> f;
    size_t start = 0;
    for (;;) {
      const size_t t = line.find('\t', start);
      f.push_back(line.substr(start, t == std::string::npos ? std::string::npos : t - start));
      if (t == std::string::npos) return f;
      start = t + 1;
    }
  }
  static bool parse_ms(const std::string& s, double* out) {
    if (s.empty()) return false;
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    if (errno != 0 || end != s.c_str() + s.size() || !(v >= 0) || v > 1e12) return false;
    *out = v;
    return true;
  }
  static bool clean_field(const std::string& s) {
    return !s.empty() && s.find('\t') == std::string::npos && s.find('\n') == std::string::npos;
  }

  void load() {
    if (path_.empty()) return;
    std::ifstream in(path_);
    if (!in) return;  // no file yet
    std::string line, why;
    std::map<Key, Choice> parsed;
    int n = 0;
    bool ok = true;
    while (ok && std::getline(in, line)) {
      ++n;
      if (n == 1) {
        if (line != kHeader) ok = false, why = "the first line is not '" + std::string(kHeader) + "'";
        continue;
      }
      if (line.empty()) continue;
      const std::vector<std::string> f = split_tabs(line);
      Choice c;
      if (f.size() != 7) {
        ok = false, why = "line " + std::to_string(n) + " has " + std::to_string(f.size()) + " fields, not 7";
      } else if (f[4] != "kiln" && f[4] != "cublaslt") {
        ok = false, why = "line " + std::to_string(n) + " chooses '" + f[4] + "'";
      } else if (!parse_ms(f[5], &c.kiln_ms) || !parse_ms(f[6], &c.cublaslt_ms)) {
        ok = false, why = "line " + std::to_string(n) + " has a bad time";
      } else {
        c.kiln = f[4] == "kiln";
        parsed[{f[0], f[1], f[2], f[3]}] = c;
      }
    }
    if (ok && n == 0) ok = false, why = "it is empty";
    if (!ok) {
      corrupt_ = true;
      std::cerr << "kiln: warning: ignoring the GEMM choice cache " << path_ << " (" << why
                << "); the choices are measured again and the file rewritten\n";
      return;
    }
    entries_ = std::move(parsed);
  }

  bool write_file(std::string* why) const {
    const size_t slash = path_.rfind('/');
    if (slash != std::string::npos && slash > 0) {
      const std::string dir = path_.substr(0, slash);
      // Create the folder and its parents (owner-only, as the JIT's cache).
      for (size_t p = 1; p <= dir.size(); ++p)
        if (p == dir.size() || dir[p] == '/') {
          const std::string sub = dir.substr(0, p);
          if (::mkdir(sub.c_str(), 0700) != 0 && errno != EEXIST) return *why = sub + ": " + std::strerror(errno), false;
        }
    }
    const std::string tmp = path_ + ".tmp." + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::trunc);
      if (!out) return *why = tmp + ": " + std::strerror(errno), false;
      out << kHeader << "\n";
      for (const auto& [k, c] : entries_) {
        const auto& [gpu, driver, ver, key] = k;
        if (!clean_field(gpu) || !clean_field(driver) || !clean_field(ver) || !clean_field(key)) continue;
        std::ostringstream ms;
        ms.precision(6);
        ms << std::fixed << c.kiln_ms << "\t" << c.cublaslt_ms;
        out << gpu << "\t" << driver << "\t" << ver << "\t" << key << "\t" << (c.kiln ? "kiln" : "cublaslt") << "\t"
            << ms.str() << "\n";
      }
      out.flush();
      if (!out) return *why = tmp + ": write failed", std::remove(tmp.c_str()), false;
    }
    if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
      *why = std::string("rename: ") + std::strerror(errno);
      std::remove(tmp.c_str());
      return false;
    }
    return true;
  }

  std::string path_;
  MachineKey machine_;
  mutable std::mutex mu_;
  std::map<Key, Choice> entries_;
  bool corrupt_ = false;
};

}  // namespace kiln::kernels::gemm
