// Work: the handle every communicator operation returns. States follow torchcomms
// (not_started, in_progress, completed, timed_out, error); wait() returns on success and
// rethrows the failure (CommTimeout, PeerLost, kiln::Error) otherwise, and never waits
// without a deadline. Also the option and error types the communicator API shares.
#pragma once
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/error.h"

namespace kiln::dist {

using Millis = std::chrono::milliseconds;
class Communicator;

enum class WorkState : uint8_t { not_started, in_progress, completed, timed_out, error };
const char* work_state_name(WorkState s);

enum class ReduceOp : uint8_t { sum, avg, min, max, product };
const char* reduce_op_name(ReduceOp op);

enum class FailurePolicy : uint8_t { abort, shrink };

// The exit status of a process the abort policy ends.
inline constexpr int kAbortExitCode = 70;

struct CommOptions {
  Millis timeout = default_timeout();        // per operation; KILN_DIST_TIMEOUT (seconds), else 600 s
  FailurePolicy policy = default_policy();   // KILN_DIST_POLICY=abort|shrink, else abort
  bool abort_process = true;                 // abort policy: exit kAbortExitCode after the report
  Millis shrink_window{2000};                // how long survivors gather before deciding
  Millis watchdog_interval{1000};
  static Millis default_timeout();
  static FailurePolicy default_policy();
};

struct CallOptions {
  std::optional<Millis> timeout;  // this call only; else the communicator's
};

class CommTimeout : public Error {
 public:
  using Error::Error;
};

// A peer died (or was dropped) and the survivors formed a smaller communicator, renumbered
// contiguously: the caller redoes what it needs on communicator().
class PeerLost : public Error {
 public:
  PeerLost(const std::string& what, std::shared_ptr<Communicator> comm, std::vector<int> lost)
      : Error(what), comm_(std::move(comm)), lost_(std::move(lost)) {}
  const std::shared_ptr<Communicator>& communicator() const { return comm_; }
  const std::vector<int>& lost_ranks() const { return lost_; }  // ranks of the old communicator

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<int> lost_;
};

class Work {
 public:
  using Clock = std::chrono::steady_clock;
  Work(std::string description, Millis timeout);
  WorkState state() const;
  bool is_completed() const { return state() == WorkState::completed; }
  // Returns once completed; rethrows a failure. Gives up (CommTimeout) when the operation has
  // not finished by its start + timeout + 10 s (its backend failed to end it).
  void wait();
  // Orders the calling thread's current device stream after the operation and returns without
  // waiting on the host, as torch's Work.wait() does for NCCL: what the caller queues next runs
  // after the collective, and the host runs ahead. Where the backend has no device stream (Gloo),
  // where the operation has already ended, or where its failure must surface here (the NCCL
  // backend under the shrink policy), the same as wait(). A failure found later (the watchdog
  // ends an operation that timed out) is raised by the communicator's next call.
  void wait_on_device();
  const std::string& description() const { return description_; }
  Millis timeout() const { return timeout_; }

  // Backend side.
  // Called by wait() between short sleeps (without the Work's lock) so the backend can end
  // finished operations at once; without it wait() sleeps until the backend's own thread ends it.
  void set_progress(std::function<void()> progress) { progress_ = std::move(progress); }
  // Called once by wait() (without the Work's lock) when the operation has not started yet: a
  // backend may run it on the waiting thread then (Gloo does when it is next in line), which
  // saves two thread hand-offs, each a scheduler wake-up on a busy machine.
  void set_on_wait(std::function<void()> on_wait) { on_wait_ = std::move(on_wait); }
  // Called by wait_on_device() (without the Work's lock) while the operation is in flight: makes
  // the caller's stream wait for it on the device and returns true, or returns false when there
  // is nothing left to order after (it has ended), and wait() follows.
  void set_device_wait(std::function<bool()> device_wait) { device_wait_ = std::move(device_wait); }
  void start();
  void complete();
  void fail(WorkState state, std::exception_ptr error);
  std::optional<Clock::time_point> started_at() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  WorkState state_ = WorkState::not_started;
  std::exception_ptr error_;
  std::string description_;
  Millis timeout_;
  Clock::time_point created_;
  std::optional<Clock::time_point> started_;
  std::function<void()> progress_;
  std::function<void()> on_wait_;
  std::function<bool()> device_wait_;
};
using WorkPtr = std::shared_ptr<Work>;

}  // namespace kiln::dist
