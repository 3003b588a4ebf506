// The compile pool, its progress line, and cancellable child processes.
#include "kiln/jit/compile_service.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kiln/core/env.h"
#include "kiln/core/error.h"

extern char** environ;

namespace kiln::jit {

struct CompileService::Job {
  std::string name;
  std::function<void(const CancelToken&)> fn;
  std::shared_ptr<CancelToken> token;
  std::promise<void> promise;
  std::chrono::steady_clock::time_point started;
  bool announced = false;  // its log line is written
};

int compile_threads() {
  const int64_t cores = std::min(std::max(1u, std::thread::hardware_concurrency()), 8u);
  int n = static_cast<int>(env_integer("KILN_COMPILE_THREADS", 1, 1024, cores));
  std::ifstream mem("/proc/meminfo");
  for (std::string line; std::getline(mem, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      const long long kb = std::atoll(line.c_str() + 13);
      n = std::min<long long>(n, std::max<long long>(1, kb / (1024 * 1024)));
    }
  }
  return std::max(n, 1);
}

CompileService& CompileService::global() {
  static CompileService* s = new CompileService(compile_threads());  // lives until exit
  return *s;
}

CompileService::CompileService(int threads) {
  for (int i = 0; i < std::max(threads, 1); ++i) workers_.emplace_back([this] { work(); });
  monitor_ = std::thread([this] { monitor(); });
}

CompileService::~CompileService() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (auto& j : queue_) j->token->cancelled = true;
    for (auto& j : running_) j->token->cancelled = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
  monitor_.join();
}

Ticket CompileService::submit(std::string name, std::function<void(const CancelToken&)> job) {
  auto j = std::make_shared<Job>();
  j->name = name;
  j->fn = std::move(job);
  j->token = std::make_shared<CancelToken>();
  Ticket t{std::move(name), j->promise.get_future().share(), j->token};
  {
    std::lock_guard<std::mutex> lock(mu_);
    KILN_CHECK(!stop_, "compile service: stopped");
    queue_.push_back(j);
  }
  cv_.notify_all();
  return t;
}

void CompileService::work() {
  for (;;) {
    std::shared_ptr<Job> j;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      j = queue_.front();
      queue_.pop_front();
      j->started = std::chrono::steady_clock::now();
      running_.push_back(j);
    }
    try {
      KILN_CHECK(!j->token->cancelled, "compile of ", j->name, " cancelled");
      j->fn(*j->token);
      j->promise.set_value();
    } catch (...) {
      j->promise.set_exception(std::current_exception());
    }
    std::lock_guard<std::mutex> lock(mu_);
    std::erase(running_, j);
    cv_.notify_all();
  }
}

void CompileService::monitor() {
  using namespace std::chrono;
  bool shown = false;
  const bool tty = ::isatty(2) != 0;  // a terminal: one line rewritten in place
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait_for(lock, milliseconds(250));
    if (stop_ && running_.empty()) break;
    const auto now = steady_clock::now();
    std::string line;
    int slow = 0;
    for (const auto& j : running_) {
      const double s = duration<double>(now - j->started).count();
      if (s < 1.0) continue;
      if (slow++ < 2) {
        char buf[64];
        std::snprintf(buf, sizeof buf, " %.0f s", s);
        line += (line.empty() ? "" : ", ") + j->name + buf;
      }
    }
    if (slow > 0 && !quiet_ && !tty) {  // a log: one line per compilation, when it passes a second
      for (const auto& j : running_) {
        if (j->announced || duration<double>(now - j->started).count() < 1.0) continue;
        j->announced = true;
        std::fprintf(stderr, "kiln: compiling %s (over 1 s so far)\n", j->name.c_str());
      }
    } else if (slow > 0 && !quiet_) {
      const size_t queued = queue_.size();
      std::fprintf(stderr, "\rkiln: compiling %d kernel%s (%s%s)%s%s", slow, slow == 1 ? "" : "s", line.c_str(),
                   slow > 2 ? ", ..." : "", queued ? (", " + std::to_string(queued) + " queued").c_str() : "",
                   "\033[K");
      shown = true;
    } else if (shown && running_.empty()) {
      if (!quiet_) std::fprintf(stderr, "\r\033[K");
      shown = false;
    }
  }
}

ProcessResult run_process(const std::vector<std::string>& argv, const CancelToken* token) {
  KILN_CHECK(!argv.empty(), "run_process: no program");
  char out_tmpl[] = "/tmp/kiln-jit-out-XXXXXX";
  const int out_fd = ::mkstemp(out_tmpl);
  KILN_CHECK(out_fd >= 0, "run_process: cannot create a temporary file: ", std::strerror(errno));
  ::unlink(out_tmpl);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_fd, 1);
  posix_spawn_file_actions_adddup2(&fa, out_fd, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ::close(out_fd);
    fail("cannot run '", argv[0], "': ", std::strerror(rc));
  }
  ProcessResult r;
  int status = 0;
  bool killed = false;
  for (;;) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) break;
    if (token && token->cancelled && !killed) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
    ::usleep(5000);
  }
  std::string out;
  ::lseek(out_fd, 0, SEEK_SET);
  char buf[4096];
  for (ssize_t n; (n = ::read(out_fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(out_fd);
  KILN_CHECK(!killed, "'", argv[0], "' cancelled");
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.output = std::move(out);
  return r;
}

}  // namespace kiln::jit
