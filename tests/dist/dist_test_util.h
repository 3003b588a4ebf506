// Helpers of the multi-process tests: run a command line with a hard deadline (coreutils
// timeout, so no test can hang) and capture its combined output and exit status; a local store
// for one-process worlds; a fresh folder per test process; a collective's result against its
// float64 reference.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "kiln/dist/backends.h"
#include "kiln/dist/shm_collectives.h"
#include "kiln/dist/store.h"
#include "kiln/ops/ops.h"
#include "tests/expect.h"
#include "tests/temp_dir.h"

namespace kiln::dist::test {

// A store server on 127.0.0.1 (an ephemeral port) and a client of it, for communicators made in
// this process (world size 1).
struct LocalStore {
  std::unique_ptr<StoreServer> server;
  std::shared_ptr<TcpStore> store;
  explicit LocalStore(const std::string& token) {
    StoreServerOptions o;
    o.token = token;
    o.quiet = true;
    server = std::make_unique<StoreServer>(o);
    store = std::make_shared<TcpStore>("127.0.0.1", server->port(), token);
  }
};

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

// This test program's own path: the ranks of multi-process tests are its DistWorker.Run.
inline std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return std::string(buf, n > 0 ? static_cast<size_t>(n) : 0);
}

// Runs case `worker` of DistWorker.Run as n ranks under kiln launch.
inline RunResult run_ranks(int n, const std::string& worker, const std::string& env = "",
                           const std::string& flags = "", int deadline_s = 90) {
  return run_command("env KILN_TEST_WORKER=" + worker + " " + env + " " + kiln_cli() + " launch --nproc-per-node " +
                         std::to_string(n) + " --master-port 0 --term-grace 1 " + flags + " -- " + self_exe() +
                         " --gtest_filter=DistWorker.Run --gtest_brief=1",
                     deadline_s);
}

// Whether this build has the Gloo backend (a build without libgloo-dev has a stub that says so).
inline bool have_gloo() {
  kiln::dist::StoreServerOptions o;
  o.token = "probe";
  o.quiet = true;
  kiln::dist::StoreServer server(o);
  auto store = std::make_shared<kiln::dist::TcpStore>("127.0.0.1", server.port(), "probe");
  try {
    kiln::dist::new_gloo_communicator(store, 0, 1, "probe");
    return true;
  } catch (const kiln::Error&) {
    return false;
  }
}
// Whether this machine can hold a POSIX shared-memory segment (a container may have no /dev/shm):
// the shared-memory collectives' tests skip, saying so, where it cannot.
inline bool have_shm() {
  const std::string name = "/kiln-probe-" + std::to_string(getpid());
  try {
    void* p = kiln::dist::system_shm_api().create(name, 4096);
    kiln::dist::system_shm_api().unmap(p, 4096);
    kiln::dist::system_shm_api().unlink(name);
    return true;
  } catch (const kiln::Error&) {
    return false;
  }
}
#define KILN_SKIP_WITHOUT_SHM() \
  if (!::kiln::dist::test::have_shm()) GTEST_SKIP() << "no POSIX shared memory here (/dev/shm): the segment cannot be made"

#define KILN_SKIP_WITHOUT_GLOO() \
  if (!::kiln::dist::test::have_gloo()) GTEST_SKIP() << "built without Gloo (Debian: libgloo-dev)"

inline bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// An empty folder of this test process's own, as a string (tests/temp_dir.h).
inline std::string fresh_test_dir(const std::string& name) { return kiln::test::fresh_temp_dir(name).string(); }

// A collective's result (any device) against the float64 reference of every rank's inputs,
// rounded to the dtype first: equal but for avg's division (kiln::test::collective_tol).
inline ::testing::AssertionResult matches_reference(const Tensor& got, const std::vector<double>& want, DType dt,
                                                    const std::string& what) {
  const std::vector<double> rounded =
      from_vector<double>(want, {static_cast<int64_t>(want.size())}).to(dt).to_vector<double>();
  return kiln::test::all_close(got, rounded, kiln::test::collective_tol(dt), what);
}

}  // namespace kiln::dist::test
