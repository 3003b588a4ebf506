// Run folder lock, stale checkpoint temporaries, and where a resumed run may write (see
// run_folder.h).
#include "kiln/train/run_folder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/report.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

// The pid written in a lock file ("" when it holds none yet: its writer is between flock and write).
int64_t read_pid(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return 0;
  try {
    return std::stoll(std::string(buf, static_cast<size_t>(n)));
  } catch (...) {
    return 0;
  }
}

bool process_alive(int64_t pid) {
  if (pid <= 0 || pid == ::getpid()) return false;  // our own pid on a leftover: an earlier process's
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

}  // namespace

RunLock::RunLock(const std::string& dir) : dir_(dir), path_((fs::path(dir) / kFileName).string()) {
  std::error_code ec;
  KILN_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec), "out '", dir,
             "' exists and is not a folder (the run folder)");
  for (fs::path p = fs::absolute(dir, ec).lexically_normal(); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    created_ = p.string();
    if (p == p.parent_path()) break;
  }
  fs::create_directories(dir, ec);
  KILN_CHECK(!ec, "out '", dir, "': cannot create the run folder: ", ec.message());
  // flock, then check that the file locked is still the one at the path: a holder that released
  // the lock unlinks the file, and a lock taken on the unlinked file would be no lock at all.
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    KILN_CHECK(fd >= 0, "out '", dir, "': cannot open its lock file ", path_, ": ", errno_text());
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      int64_t pid = read_pid(fd);
      for (int k = 0; k < 20 && pid == 0; ++k) {  // the holder writes its pid right after flock
        ::usleep(5000);
        pid = read_pid(fd);
      }
      ::close(fd);
      KILN_CHECK(err == EWOULDBLOCK, "out '", dir, "': cannot lock ", path_, ": ", std::strerror(err));
      fail(dir, " is in use by pid ", pid > 0 ? std::to_string(pid) : std::string("?"),
           " (another kiln run writes there; wait for it to end, or choose another --out)");
    }
    struct stat held {}, now {};
    if (::fstat(fd, &held) == 0 && ::stat(path_.c_str(), &now) == 0 && held.st_ino == now.st_ino &&
        held.st_dev == now.st_dev) {
      fd_ = fd;
      break;
    }
    ::close(fd);
  }
  KILN_CHECK(fd_ >= 0, "out '", dir, "': its lock file ", path_, " keeps changing (another process replaces it)");
  const std::string pid = std::to_string(::getpid()) + "\n";
  const bool written = ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, pid.data(), pid.size(), 0) ==
                                                      static_cast<ssize_t>(pid.size());
  if (!written) {
    const std::string why = errno_text();
    ::close(fd_);
    fail("out '", dir, "': cannot write its lock file ", path_, ": ", why);
  }
}

RunLock::~RunLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // while still held: a process waiting on the old file sees it replaced
  ::close(fd_);
  if (created_.empty()) return;
  std::error_code ec;  // the folders this lock created, while nothing else was put in them
  for (fs::path p = fs::absolute(dir_, ec).lexically_normal(); !p.empty(); p = p.parent_path()) {
    if (!fs::is_empty(p, ec) || !fs::remove(p, ec)) break;
    if (p.string() == created_ || p == p.parent_path()) break;
  }
}

int64_t run_folder_holder(const std::string& dir) {
  const std::string path = (fs::path(dir) / RunLock::kFileName).string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  int64_t pid = 0;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0) pid = std::max<int64_t>(read_pid(fd), 1);
  ::close(fd);
  return pid;
}

std::string remove_stale_temporaries(const std::string& dir) {
  std::vector<fs::path> stale;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == ".latest.tmp") {
      stale.push_back(e.path());
      continue;
    }
    if (!e.is_directory(ec) || !(name.rfind(".tmp-", 0) == 0 || name.rfind(".old-", 0) == 0)) continue;
    const size_t dash = name.rfind('-');
    int64_t pid = 0;
    try {
      size_t used = 0;
      pid = std::stoll(name.substr(dash + 1), &used);
      if (used != name.size() - dash - 1) continue;
    } catch (...) {
      continue;  // not a name write_dir_atomic gives
    }
    if (!process_alive(pid)) stale.push_back(e.path());
  }
  if (stale.empty()) return "";
  uint64_t bytes = 0;
  std::string names;
  for (const auto& p : stale) {
    for (const auto& f : fs::recursive_directory_iterator(p, ec))
      if (f.is_regular_file(ec)) bytes += f.file_size(ec);
    if (fs::is_regular_file(p, ec)) bytes += fs::file_size(p, ec);
    fs::remove_all(p, ec);
    KILN_CHECK(!ec, "train: cannot remove the stale checkpoint temporary ", p.string(), ": ", ec.message());
    names += (names.empty() ? "" : ", ") + p.filename().string();
  }
  return "note: removed " + std::to_string(stale.size()) + " checkpoint temporar" + (stale.size() == 1 ? "y" : "ies") +
         " that a killed run left in " + dir + " (" + names + ", " + format_bytes(static_cast<int64_t>(bytes)) + ")";
}

void check_resume_out(const std::string& ckpt_dir, const std::string& out) {
  std::error_code ec;
  const fs::path run = fs::absolute(ckpt_dir, ec).lexically_normal().parent_path();
  if (!fs::exists(out, ec) || fs::equivalent(out, run, ec) || fs::equivalent(out, ckpt_dir, ec)) return;
  const EarlierRun other = earlier_run(out);
  KILN_CHECK(!other.exists(), "--out ", out, " holds another run (", other.what, "), and a resumed run writes only into ",
             "its own run folder (", run.string(), ") or an empty one: leave --out out to continue in ", run.string(),
             ", or choose an empty --out");
}

std::string run_folder_job(const std::string& dir) {
  std::ifstream f(fs::path(dir) / kJobFileName);
  std::string job;
  std::getline(f, job);
  return job;
}

void mark_run_folder_job(const std::string& dir, const std::string& job) {
  const fs::path tmp = fs::path(dir) / (std::string(kJobFileName) + ".tmp");
  write_text_file_synced(tmp.string(), job + "\n");
  fs::rename(tmp, fs::path(dir) / kJobFileName);
}

}  // namespace kiln::train
