// The JIT's compile service (docs/jit.md, "Compilation"): a pool of threads that run
// compilations as futures. KILN_COMPILE_THREADS threads (default min(cores, 8)), never more
// than the available memory allows at about 1 GiB a compilation. Any compilation running longer
// than a second shows a progress line on stderr (what compiles, how long so far), updated each
// second, so a cold start never looks like a hang. A ticket can be cancelled: a queued job is
// dropped, a running one sees its token and kills its compiler (run_process).
//
// CompileService::global() is the process's one pool (a registry-kind global, created on first
// use; its threads stop when the program exits).
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kiln::jit {

struct CancelToken {
  std::atomic<bool> cancelled{false};
};

// A submitted job: wait() returns when it has run (rethrowing its error), cancel() stops it.
struct Ticket {
  std::string name;
  std::shared_future<void> done;
  std::shared_ptr<CancelToken> token;
  void wait() const { done.get(); }
  void cancel() const { token->cancelled = true; }
};

// The number of compile threads: KILN_COMPILE_THREADS when set (>= 1, else an error naming it),
// else min(hardware threads, 8); then at most MemAvailable / 1 GiB, and at least 1.
int compile_threads();

class CompileService {
 public:
  static CompileService& global();
  explicit CompileService(int threads);
  ~CompileService();
  CompileService(const CompileService&) = delete;
  CompileService& operator=(const CompileService&) = delete;

  Ticket submit(std::string name, std::function<void(const CancelToken&)> job);
  int threads() const { return static_cast<int>(workers_.size()); }
  // Progress lines go to stderr unless quiet (tests); the threshold is one second.
  void set_quiet(bool quiet) { quiet_ = quiet; }

 private:
  struct Job;
  void work();
  void monitor();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::shared_ptr<Job>> running_;
  bool stop_ = false;
  std::atomic<bool> quiet_{false};
  std::vector<std::thread> workers_;
  std::thread monitor_;
};

struct ProcessResult {
  int status = -1;     // the exit status; -1 when killed or not started
  std::string output;  // stdout and stderr together
};
// Runs argv[0] (a path) with argv, its output captured, waiting for it while polling `token`
// (a cancelled token kills it and raises an error). An error when it cannot start.
ProcessResult run_process(const std::vector<std::string>& argv, const CancelToken* token = nullptr);

}  // namespace kiln::jit
