// Structured JSON-lines logs (dist_log.h). Lines are appended with one write() each under a
// process-wide mutex, so lines of several threads never interleave.
#include "kiln/dist/dist_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <mutex>

namespace kiln::dist {
namespace {

std::mutex& log_mutex() {  // one per process: the log files are shared by every communicator
  static std::mutex m;
  return m;
}

void append_line(const std::string& path, const json::Value& event) {
  const std::string line = event.dump() + "\n";
  std::lock_guard<std::mutex> lock(log_mutex());
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;  // logging never fails an operation
  [[maybe_unused]] ssize_t n = write(fd, line.data(), line.size());
  close(fd);
}

}  // namespace

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void launcher_event(const std::string& dir, json::Value event) {
  if (dir.empty()) return;
  event["ts"] = unix_seconds();
  event["source"] = "launcher";
  append_line(dir + "/launcher.jsonl", event);
}

void rank_event(json::Value event) {
  const char* dir = std::getenv("KILN_DIST_LOG_DIR");
  if (!dir || !*dir) return;
  const char* rank = std::getenv("RANK");
  const std::string r = rank && *rank ? rank : "0";
  event["ts"] = unix_seconds();
  event["rank"] = static_cast<int64_t>(std::atoll(r.c_str()));
  append_line(std::string(dir) + "/rank" + r + ".jsonl", event);
}

bool trace_ops() {
  const char* t = std::getenv("KILN_DIST_TRACE");
  return t && std::string(t) == "1";
}

}  // namespace kiln::dist
