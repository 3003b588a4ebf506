// Runs the kiln program built with the tests (KILN_CLI_COMMAND: behind qemu in the cross build)
// and returns its exit status and its stdout and stderr together, for tests of command-line
// behaviour.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace kiln::test {

struct CliOutcome {
  int status = -1;  // the exit status; -1 when killed by a signal
  std::string output;
};

inline CliOutcome run_kiln(const std::string& args) {
  FILE* p = ::popen((std::string(KILN_CLI_COMMAND) + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return {};
  CliOutcome r;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

}  // namespace kiln::test
