// Helpers of the multi-process tests: run a command line with a hard deadline (coreutils
// timeout, so no test can hang) and capture its combined output and exit status.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace kiln::dist::test {

struct RunResult {
  int status = -1;  // exit status, or 128 + signal
  std::string output;
};

inline RunResult run_command(const std::string& cmd, int deadline_s = 60) {
  RunResult r;
  const std::string full = "timeout -k 2 " + std::to_string(deadline_s) + " " + cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

inline std::string kiln_cli() { return KILN_CLI_PATH; }

inline bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

}  // namespace kiln::dist::test
