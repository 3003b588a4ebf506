// `kiln telemetry` tests: run the built program (KILN_CLI_COMMAND) and check its JSON lines, its
// table, its errors and that Ctrl-C ends a watch cleanly.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iterator>
#include <sstream>

#include "kiln/core/device.h"
#include "kiln/io/json.h"

extern char** environ;

using namespace kiln;

namespace {

// A running `kiln` with its stdout and stderr piped to us.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    int out[2], err[2];
    if (pipe(out) != 0 || pipe(err) != 0) throw std::runtime_error("pipe failed");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_adddup2(&fa, err[1], 2);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    posix_spawn_file_actions_addclose(&fa, err[0]);
    // Through a shell that execs KILN_CLI_COMMAND (behind qemu in the cross build): the pid
    // signalled below is then kiln's (or the emulator's, which hands the signal on).
    std::vector<std::string> argv_s = {"/bin/sh", "-c", std::string("exec ") + KILN_CLI_COMMAND + " \"$@\"", "kiln"};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = posix_spawn(&pid_, "/bin/sh", &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(out[1]);
    close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
    if (rc != 0) throw std::runtime_error("posix_spawn failed");
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    close(out_fd_);
    close(err_fd_);
  }
  // Reads stdout until it holds `lines` newlines or `timeout_s` passed; returns what came.
  const std::string& read_stdout_lines(size_t lines, double timeout_s) {
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::count(out_.begin(), out_.end(), '\n') < static_cast<long>(lines) &&
           std::chrono::steady_clock::now() < end) {
      pollfd p{out_fd_, POLLIN, 0};
      if (poll(&p, 1, 50) > 0 && !drain(out_fd_, out_)) break;
    }
    return out_;
  }
  void signal(int sig) { kill(pid_, sig); }
  // CPU time (user + system) the running child has used so far, from /proc/<pid>/stat.
  double cpu_seconds() const {
    std::ifstream f("/proc/" + std::to_string(pid_) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::istringstream rest(stat.substr(stat.rfind(')') + 2));  // fields after "(comm) ": state is field 3
    std::string field;
    double ticks = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i)
      if (i >= 14) ticks += std::stod(field);  // 14: utime, 15: stime
    return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  // Reads both pipes to their end and waits; returns the exit status (-signal when killed).
  int wait() {
    bool out_open = true, err_open = true;
    while (out_open || err_open) {
      pollfd p[2] = {{out_fd_, static_cast<short>(out_open ? POLLIN : 0), 0},
                     {err_fd_, static_cast<short>(err_open ? POLLIN : 0), 0}};
      if (poll(p, 2, 30000) <= 0) break;  // a hung child fails the test instead of hanging it
      if (out_open && (p[0].revents & (POLLIN | POLLHUP))) out_open = drain(out_fd_, out_);
      if (err_open && (p[1].revents & (POLLIN | POLLHUP))) err_open = drain(err_fd_, err_);
    }
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

 private:
  static bool drain(int fd, std::string& into) {
    char buf[4096];
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) return false;
    into.append(buf, static_cast<size_t>(n));
    return true;
  }
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  std::string out_, err_;
};

struct Result {
  int code;
  std::string out, err;
};
Result run(const std::vector<std::string>& args) {
  Child c(args);
  int code = c.wait();
  return {code, c.out(), c.err()};
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string l; std::getline(ss, l);) out.push_back(l);
  return out;
}

}  // namespace

TEST(TelemetryCli, JsonLinesWatch) {
  Result r = run({"telemetry", "--json", "--count", "2", "--watch", "0.1", "--device", "cpu"});
  ASSERT_EQ(r.code, 0) << r.err;
  auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 2u) << r.out;
  double last_time = 0;
  for (const auto& l : ls) {
    json::Value j = json::parse(l);
    EXPECT_EQ(j.find("device")->as_string(), "cpu");
    for (const char* key : {"memory_used_bytes", "memory_total_bytes", "utilization_pct", "power_w",
                            "sm_clock_mhz", "mem_clock_mhz", "temperature_c", "time", "kiln_current_bytes",
                            "kiln_peak_bytes", "cpu_clock_mhz", "process_rss_bytes"})
      EXPECT_TRUE(j.contains(key)) << key << " missing in " << l;
    int64_t total = j.find("memory_total_bytes")->as_int();
    int64_t used = j.find("memory_used_bytes")->as_int();
    EXPECT_GT(used, 0);
    EXPECT_LE(used, total);
    EXPECT_GT(j.find("process_rss_bytes")->as_int(), 0);
    double u = j.find("utilization_pct")->as_double();
    EXPECT_GE(u, 0.0);
    EXPECT_LE(u, 100.0);
    EXPECT_TRUE(j.find("sm_clock_mhz")->is_null());  // a GPU field
    double t = j.find("time")->as_double();
    EXPECT_GE(t, last_time);
    last_time = t;
  }
}

TEST(TelemetryCli, AllDevicesDefault) {
  Result r = run({"telemetry", "--json"});  // one sample of every device
  ASSERT_EQ(r.code, 0) << r.err;
  auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), static_cast<size_t>(1 + cuda_device_count())) << r.out;
  EXPECT_EQ(json::parse(ls[0]).find("device")->as_string(), "cpu");
  for (size_t i = 1; i < ls.size(); ++i)
    EXPECT_EQ(json::parse(ls[i]).find("device")->as_string(), "cuda:" + std::to_string(i - 1));
}

TEST(TelemetryCli, Table) {
  Result r = run({"telemetry", "--device", "cpu", "--count", "3", "--watch", "0.05"});
  ASSERT_EQ(r.code, 0) << r.err;
  auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 5u) << r.out;  // two header lines, three rows
  EXPECT_EQ(ls[0].rfind("# time", 0), 0u) << ls[0];
  EXPECT_NE(ls[0].find("mem_used"), std::string::npos);
  EXPECT_NE(ls[1].find("MiB"), std::string::npos);
  for (size_t i = 2; i < 5; ++i) {
    std::stringstream ss(ls[i]);
    std::vector<std::string> cells;
    for (std::string c; ss >> c;) cells.push_back(c);
    ASSERT_EQ(cells.size(), 13u) << ls[i];
    EXPECT_EQ(cells[1], "cpu");
    EXPECT_EQ(cells[8], "-") << ls[i];  // memory clock: a GPU field
    EXPECT_GT(std::stod(cells[3]), 0.0);  // total MiB
  }
}

TEST(TelemetryCli, CudaDeviceWithoutCudaIsOneLineError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has CUDA devices";
  Result r = run({"telemetry", "--device", "cuda:0"});
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(r.out.empty()) << r.out;
  auto ls = lines(r.err);
  ASSERT_EQ(ls.size(), 1u) << r.err;
  EXPECT_NE(ls[0].find("cuda:0"), std::string::npos) << ls[0];
}

TEST(TelemetryCli, BadArguments) {
  for (const auto& args : std::vector<std::vector<std::string>>{{"telemetry", "--count", "0"},
                                                                {"telemetry", "--watch", "0"},
                                                                {"telemetry", "--watch", "-1"},
                                                                {"telemetry", "--device", "tpu"},
                                                                {"telemetry", "--frobnicate"}}) {
    Result r = run(args);
    EXPECT_EQ(r.code, 1) << args.back();
    EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
  }
}

TEST(TelemetryCli, CtrlCStopsAWatchCleanly) {
  Child c({"telemetry", "--json", "--device", "cpu", "--watch", "0.05"});
  std::string first = c.read_stdout_lines(2, 20.0);
  ASSERT_GE(std::count(first.begin(), first.end(), '\n'), 2) << "no samples came";
  c.signal(SIGINT);
  EXPECT_EQ(c.wait(), 0) << c.err();
  auto ls = lines(c.out());
  ASSERT_GE(ls.size(), 2u);
  for (const auto& l : ls) EXPECT_NO_THROW(json::parse(l)) << l;  // no half-written line
}

TEST(TelemetryCli, HugeWatchIntervalSleepsInsteadOfSpinning) {
  Child c({"telemetry", "--json", "--device", "cpu", "--watch", "1e300", "--count", "2"});
  std::string first = c.read_stdout_lines(1, 20.0);
  ASSERT_EQ(std::count(first.begin(), first.end(), '\n'), 1) << "no sample came";
  // The CPU used while waiting for the second sample, which never comes (not the start-up's:
  // a CUDA build's start costs most of a second of CPU on the GPU machine).
  const double before = c.cpu_seconds();
  usleep(1500 * 1000);
  const double waited = c.cpu_seconds() - before;
  c.signal(SIGINT);
  EXPECT_EQ(c.wait(), 0) << c.err();
  EXPECT_EQ(lines(c.out()).size(), 1u) << c.out();
  EXPECT_LT(waited, 0.5) << "the wait used the CPU";
}
