// kiln launch (launcher.h): fork/exec of the ranks with pipes for their output, an output pump
// thread that prefixes lines, a 0.1 s monitor loop over waitpid, the failure report (a rank that
// exited with the abort policy's status is named first only when no other rank failed with it),
// the SIGTERM-then-SIGKILL stop, restarts, and the launcher's own JSON-lines log.
#include "kiln/dist/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "kiln/core/error.h"
#include "kiln/dist/auth.h"
#include "kiln/dist/dist_log.h"
#include "kiln/dist/store.h"
#include "kiln/dist/work.h"
#include "kiln/io/json.h"

extern char** environ;

namespace kiln::dist {
namespace {

using Clock = std::chrono::steady_clock;

// The launcher's own SIGINT / SIGTERM: recorded here (a signal handler can only set a flag),
// read by the monitor loop, which stops the ranks and exits 128 + signal.
std::atomic<int> g_launcher_signal{0};
extern "C" void on_launcher_signal(int sig) { g_launcher_signal.store(sig); }

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int s = WTERMSIG(status);
    const char* name = sigabbrev_np(s);
    return "signal " + std::to_string(s) + (name ? std::string(" (SIG") + name + ")" : std::string());
  }
  return "status " + std::to_string(status);
}

struct Child {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;  // read ends, -1 once at EOF
  std::optional<int> status;
  Clock::time_point started, ended;
  std::deque<std::string> tail;
  std::string partial[2];
  std::unique_ptr<std::ofstream> log;
  bool noted = false;  // a later failure under shrink, said
};

// As torchrun: ranks that share a machine share its cores, so unless OMP_NUM_THREADS is set each
// rank gets the cores this launcher may run on divided by the ranks per node (torchrun sets 1);
// "" leaves it as it is.
std::string omp_threads_per_rank(int nproc_per_node) {
  if (nproc_per_node <= 1 || std::getenv("OMP_NUM_THREADS") != nullptr) return "";
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                                : static_cast<int>(std::thread::hardware_concurrency());
  return std::to_string(std::max(1, cores / nproc_per_node));
}

bool exited_ok(const Child& c) { return c.status && WIFEXITED(*c.status) && WEXITSTATUS(*c.status) == 0; }

class Job {
 public:
  // omp_threads: every rank's OMP_NUM_THREADS ("" leaves the environment's).
  Job(const LaunchOptions& o, const std::string& token, int store_port, int attempt, std::string omp_threads)
      : o_(o), token_(token), store_port_(store_port), attempt_(attempt), omp_threads_(std::move(omp_threads)) {}

  void start() {
    KILN_CHECK(pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0, "kiln launch: pipe: ", std::strerror(errno));
    for (int i = 0; i < o_.nproc_per_node; ++i) spawn(i);
    pump_ = std::thread([this] { pump(); });
  }

  // Returns when every rank has exited, a rank failed (abort policy) or the launcher was
  // signalled. Sets failed_first_ to the first failure.
  void monitor(bool shrink) {
    while (true) {
      reap();
      if (g_launcher_signal.load()) return;
      bool all_done = true;
      for (auto& c : children_) all_done = all_done && c.status.has_value();
      if (first_failure_ >= 0 && !reported_) {
        report(children_[first_failure_]);
        reported_ = true;
        if (!shrink) {
          // The survivors' communicators see the failure too and, under the abort policy, exit
          // within about a second naming the op: let them say so before they are stopped.
          const auto settle = Clock::now() + std::chrono::duration<double>(o_.settle_s);
          while (Clock::now() < settle) {
            reap();
            bool alive = false;
            for (auto& c : children_) alive = alive || !c.status;
            if (!alive || g_launcher_signal.load()) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
          return;
        }
        std::fprintf(stderr, "kiln launch: policy shrink: the other ranks go on without rank %d\n",
                     children_[first_failure_].rank);
      }
      if (shrink && reported_) {  // a later loss: said in one line
        for (size_t i = 0; i < children_.size(); ++i) {
          Child& c = children_[i];
          if (static_cast<int>(i) == first_failure_ || !c.status || c.noted || exited_ok(c)) continue;
          c.noted = true;
          std::fprintf(stderr, "kiln launch: rank %d (pid %d) failed too: %s after %.1f s; policy shrink: the "
                       "others go on without it\n", c.rank, c.pid, describe_status(*c.status).c_str(),
                       std::chrono::duration<double>(c.ended - c.started).count());
        }
      }
      if (all_done) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  void stop_all(double grace_s) {
    bool any = false;
    for (auto& c : children_)
      if (!c.status) {
        kill(-c.pid, SIGTERM);
        any = true;
      }
    if (!any) return;
    std::fprintf(stderr, "kiln launch: stopping the other ranks (SIGTERM, then SIGKILL after %.1f s)\n", grace_s);
    const auto deadline = Clock::now() + std::chrono::duration<double>(grace_s);
    while (Clock::now() < deadline) {
      reap();
      bool alive = false;
      for (auto& c : children_) alive = alive || !c.status;
      if (!alive) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (auto& c : children_)
      if (!c.status) kill(-c.pid, SIGKILL);
    for (auto& c : children_)
      if (!c.status) {
        int st = 0;
        waitpid(c.pid, &st, 0);
        c.status = st;
        c.ended = Clock::now();
      }
  }

  // Ends the output pump: waits up to 1 s for the pipes to drain (a grandchild may hold them).
  void finish() {
    const auto deadline = Clock::now() + std::chrono::seconds(1);
    while (Clock::now() < deadline && open_fds() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    stop_pump_ = true;
    const char b = 1;
    [[maybe_unused]] ssize_t w = write(wake_[1], &b, 1);
    if (pump_.joinable()) pump_.join();
    for (auto& c : children_) {
      for (int k = 0; k < 2; ++k)
        if (!c.partial[k].empty()) emit(c, k, c.partial[k]);
      if (c.out_fd >= 0) close(c.out_fd);
      if (c.err_fd >= 0) close(c.err_fd);
    }
    close(wake_[0]);
    close(wake_[1]);
  }

  // Every rank exited 0; under shrink, some rank did and each other one ended before the first
  // that did (it was lost, and the survivors went on without it: a rank that fails after the
  // job's end, or with no survivor, fails the job).
  bool succeeded(bool shrink) const {
    std::optional<Clock::time_point> first_ok;
    for (const auto& c : children_)
      if (exited_ok(c) && (!first_ok || c.ended < *first_ok)) first_ok = c.ended;
    for (const auto& c : children_) {
      if (exited_ok(c)) continue;
      if (!shrink || !first_ok || !c.status || !(c.ended < *first_ok)) return false;
    }
    return true;
  }
  // The ranks that failed, in the order they ended ("1" or "2, 0").
  std::string failed_ranks() const {
    std::vector<const Child*> failed;
    for (const auto& c : children_)
      if (!exited_ok(c)) failed.push_back(&c);
    std::sort(failed.begin(), failed.end(), [](const Child* a, const Child* b) { return a->ended < b->ended; });
    std::string out;
    for (const Child* c : failed) out += (out.empty() ? "" : ", ") + std::to_string(c->rank);
    return out;
  }
  int first_failure() const { return first_failure_; }

 private:
  int open_fds() {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (auto& c : children_) n += (c.out_fd >= 0) + (c.err_fd >= 0);
    return n;
  }

  void spawn(int local) {
    Child c;
    c.local_rank = local;
    c.rank = o_.node_rank * o_.nproc_per_node + local;
    int out[2], err[2];
    KILN_CHECK(pipe2(out, O_CLOEXEC) == 0 && pipe2(err, O_CLOEXEC) == 0, "kiln launch: pipe: ",
               std::strerror(errno));
    std::map<std::string, std::string> env;
    for (char** e = environ; *e; ++e) {
      const char* eq = std::strchr(*e, '=');
      if (eq) env[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
    }
    const int world = o_.nnodes * o_.nproc_per_node;
    env["RANK"] = std::to_string(c.rank);
    env["LOCAL_RANK"] = std::to_string(local);
    env["GROUP_RANK"] = std::to_string(o_.node_rank);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_WORLD_SIZE"] = std::to_string(o_.nproc_per_node);
    env["MASTER_ADDR"] = o_.master_addr;
    env["MASTER_PORT"] = std::to_string(store_port_);
    env["KILN_STORE_ADDR"] = o_.master_addr;
    env["KILN_STORE_PORT"] = std::to_string(store_port_);
    env["KILN_STORE_TOKEN"] = token_;
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt_);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o_.max_restarts);
    if (!o_.policy.empty()) env["KILN_DIST_POLICY"] = o_.policy;
    if (!omp_threads_.empty()) env["OMP_NUM_THREADS"] = omp_threads_;
    if (!o_.log_dir.empty()) {
      env["KILN_DIST_LOG_DIR"] = o_.log_dir;
      if (!env.count("KILN_FR_DUMP_DIR")) env["KILN_FR_DUMP_DIR"] = o_.log_dir;
    }
    std::vector<std::string> env_strings;
    for (auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp, argv;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = o_.program;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    KILN_CHECK(pid >= 0, "kiln launch: fork: ", std::strerror(errno));
    if (pid == 0) {
      setpgid(0, 0);  // its own group, so a stop reaches what the rank started too
      dup2(out[1], 1);
      dup2(err[1], 2);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      execvpe(argv[0], argv.data(), envp.data());
      std::fprintf(stderr, "kiln launch: cannot run '%s': %s\n", argv[0], std::strerror(errno));
      _exit(127);
    }
    setpgid(pid, pid);
    close(out[1]);
    close(err[1]);
    c.pid = pid;
    c.out_fd = out[0];
    c.err_fd = err[0];
    c.started = Clock::now();
    if (!o_.log_dir.empty())
      c.log = std::make_unique<std::ofstream>(o_.log_dir + "/rank" + std::to_string(c.rank) + ".log",
                                              std::ios::app);
    children_.push_back(std::move(c));
  }

  void emit(Child& c, int stream, const std::string& line) {
    const std::string text = "[rank " + std::to_string(c.rank) + "] " + line + "\n";
    std::fwrite(text.data(), 1, text.size(), stream == 0 ? stdout : stderr);
    std::fflush(stream == 0 ? stdout : stderr);
    if (c.log) *c.log << line << "\n" << std::flush;
    c.tail.push_back(line);
    while (static_cast<int>(c.tail.size()) > o_.tail_lines) c.tail.pop_front();
  }

  void pump() {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, int>> who;  // child index, stream
    char buf[65536];
    while (!stop_pump_) {
      fds.assign(1, {wake_[0], POLLIN, 0});
      who.assign(1, {-1, -1});
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (size_t i = 0; i < children_.size(); ++i) {
          if (children_[i].out_fd >= 0) { fds.push_back({children_[i].out_fd, POLLIN, 0}); who.push_back({int(i), 0}); }
          if (children_[i].err_fd >= 0) { fds.push_back({children_[i].err_fd, POLLIN, 0}); who.push_back({int(i), 1}); }
        }
      }
      if (fds.size() == 1) break;
      if (poll(fds.data(), fds.size(), 200) <= 0) continue;
      for (size_t j = 1; j < fds.size(); ++j) {
        if (!(fds[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        std::lock_guard<std::mutex> lock(mu_);
        Child& c = children_[who[j].first];
        const int k = who[j].second;
        const ssize_t n = read(fds[j].fd, buf, sizeof buf);
        if (n <= 0) {
          close(fds[j].fd);
          (k == 0 ? c.out_fd : c.err_fd) = -1;
          continue;
        }
        c.partial[k].append(buf, static_cast<size_t>(n));
        size_t nl;
        while ((nl = c.partial[k].find('\n')) != std::string::npos) {
          emit(c, k, c.partial[k].substr(0, nl));
          c.partial[k].erase(0, nl + 1);
        }
      }
    }
  }

  void reap() {
    int failed = -1, consequence = -1;  // of the ranks found ended now
    for (size_t i = 0; i < children_.size(); ++i) {
      Child& c = children_[i];
      if (c.status) continue;
      int st = 0;
      if (waitpid(c.pid, &st, WNOHANG) == c.pid) {
        c.status = st;
        c.ended = Clock::now();
        const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        // A rank that exits kAbortExitCode is reporting another's failure (its communicator saw
        // a peer fail): when both ended within one poll, the other one failed first.
        const bool reports_another = WIFEXITED(st) && WEXITSTATUS(st) == kAbortExitCode;
        if (!ok && reports_another && consequence < 0) consequence = static_cast<int>(i);
        if (!ok && !reports_another && failed < 0) failed = static_cast<int>(i);
      }
    }
    if (first_failure_ < 0) first_failure_ = failed >= 0 ? failed : consequence;
  }

  void report(Child& c) {
    // Let its last output arrive before quoting it.
    const auto deadline = Clock::now() + std::chrono::seconds(1);
    while (Clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (c.out_fd < 0 && c.err_fd < 0) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::lock_guard<std::mutex> lock(mu_);
    const double secs = std::chrono::duration<double>(c.ended - c.started).count();
    std::fprintf(stderr, "kiln launch: rank %d (pid %d) failed first: %s after %.1f s\n", c.rank, c.pid,
                 describe_status(*c.status).c_str(), secs);
    if (!c.tail.empty()) {
      std::fprintf(stderr, "kiln launch: its last %zu lines of output:\n", c.tail.size());
      for (const auto& l : c.tail) std::fprintf(stderr, "    %s\n", l.c_str());
    } else {
      std::fprintf(stderr, "kiln launch: it printed nothing\n");
    }
    json::Value e = json::Value::object();
    e["event"] = "rank_failed";
    e["rank"] = c.rank;
    e["pid"] = static_cast<int64_t>(c.pid);
    e["status"] = describe_status(*c.status);
    e["attempt"] = attempt_;
    e["seconds"] = secs;
    launcher_event(o_.log_dir, e);
  }

  const LaunchOptions& o_;
  std::string token_;
  int store_port_;
  int attempt_;
  std::string omp_threads_;
  std::mutex mu_;
  std::vector<Child> children_;
  std::thread pump_;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_pump_{false};
  int first_failure_ = -1;
  bool reported_ = false;
};

}  // namespace

int launch(const LaunchOptions& o) {
  KILN_CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= 1024, "kiln launch: --nproc-per-node ",
             o.nproc_per_node, " out of range [1, 1024]");
  KILN_CHECK(o.nnodes >= 1, "kiln launch: --nnodes ", o.nnodes, " must be at least 1");
  KILN_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, "kiln launch: --node-rank ", o.node_rank,
             " out of range [0, ", o.nnodes, ")");
  KILN_CHECK(o.master_port >= 0 && o.master_port <= 65535, "kiln launch: --master-port ", o.master_port,
             " out of range [0, 65535]");
  KILN_CHECK(!(o.master_port == 0 && o.nnodes > 1), "kiln launch: --master-port 0 needs a single node "
             "(the other nodes must know the port)");
  KILN_CHECK(o.max_restarts >= 0, "kiln launch: --max-restarts ", o.max_restarts, " must be >= 0");
  KILN_CHECK(o.policy.empty() || o.policy == "abort" || o.policy == "shrink", "kiln launch: --policy '", o.policy,
             "' (expected abort or shrink)");
  KILN_CHECK(!o.program.empty(), "kiln launch: no program given (kiln launch [options] -- PROGRAM ARGS...)");
  if (!o.log_dir.empty()) {
    mkdir(o.log_dir.c_str(), 0755);
    struct stat st {};
    KILN_CHECK(stat(o.log_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "kiln launch: --log-dir '", o.log_dir,
               "' is not a folder that can be created");
  }
  const char* env_token = std::getenv("KILN_STORE_TOKEN");
  KILN_CHECK(o.nnodes == 1 || (env_token && *env_token), "kiln launch: with --nnodes ", o.nnodes,
             " every node needs the same secret: export KILN_STORE_TOKEN on each");
  const std::string token = env_token && *env_token ? env_token : random_token();
  std::unique_ptr<StoreServer> server;
  int port = o.master_port;
  if (o.node_rank == 0) {
    StoreServerOptions so;
    so.token = token;
    so.port = o.master_port;
    const bool loopback = o.master_addr == "127.0.0.1" || o.master_addr == "localhost" || o.master_addr == "::1";
    so.host = loopback ? "127.0.0.1" : o.master_addr;
    server = std::make_unique<StoreServer>(so);
    port = server->port();
  }
  struct sigaction sa {};
  sa.sa_handler = on_launcher_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  g_launcher_signal = 0;
  const bool shrink = o.policy == "shrink";
  const std::string omp_threads = omp_threads_per_rank(o.nproc_per_node);
  if (!omp_threads.empty())
    std::fprintf(stderr, "kiln launch: OMP_NUM_THREADS=%s for each of the %d ranks of this machine (set it to choose)\n",
                 omp_threads.c_str(), o.nproc_per_node);
  for (int attempt = 0;; ++attempt) {
    json::Value e = json::Value::object();
    e["event"] = "start";
    e["attempt"] = attempt;
    e["world_size"] = o.nnodes * o.nproc_per_node;
    e["master_port"] = port;
    launcher_event(o.log_dir, e);
    Job job(o, token, port, attempt, omp_threads);
    job.start();
    job.monitor(shrink);
    if (const int sig = g_launcher_signal.load()) {
      std::fprintf(stderr, "kiln launch: got signal %d: stopping the ranks\n", sig);
      job.stop_all(o.term_grace_s);
      job.finish();
      return 128 + sig;
    }
    job.stop_all(o.term_grace_s);
    job.finish();
    if (job.succeeded(shrink)) {
      if (job.first_failure() >= 0) {
        const std::string failed = job.failed_ranks();
        std::fprintf(stderr, "kiln launch: the surviving ranks finished (rank%s %s failed)\n",
                     failed.find(',') == std::string::npos ? "" : "s", failed.c_str());
      }
      return 0;
    }
    if (attempt >= o.max_restarts) {
      std::fprintf(stderr, "kiln launch: the job failed%s\n",
                   o.max_restarts > 0 ? (" after " + std::to_string(o.max_restarts) + " restarts").c_str() : "");
      return 1;
    }
    std::fprintf(stderr, "kiln launch: restarting every rank (restart %d of %d)\n", attempt + 1, o.max_restarts);
    if (server) server->clear();
  }
}

}  // namespace kiln::dist
