// Work and the shared option types (work.h).
#include "kiln/dist/work.h"

#include <cstdlib>
#include <cstring>

namespace kiln::dist {

const char* work_state_name(WorkState s) {
  switch (s) {
    case WorkState::not_started: return "not_started";
    case WorkState::in_progress: return "in_progress";
    case WorkState::completed: return "completed";
    case WorkState::timed_out: return "timed_out";
    case WorkState::error: return "error";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::product: return "product";
  }
  return "?";
}

Millis CommOptions::default_timeout() {
  const char* v = std::getenv("KILN_DIST_TIMEOUT");
  if (!v || !*v) return std::chrono::seconds(600);
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  KILN_CHECK(end && *end == '\0' && s > 0 && s <= 7 * 24 * 3600, "KILN_DIST_TIMEOUT='", v,
             "': expected seconds, a number in (0, 604800]");
  return Millis(static_cast<int64_t>(s * 1000));
}

FailurePolicy CommOptions::default_policy() {
  const char* v = std::getenv("KILN_DIST_POLICY");
  if (!v || !*v || std::strcmp(v, "abort") == 0) return FailurePolicy::abort;
  if (std::strcmp(v, "shrink") == 0) return FailurePolicy::shrink;
  fail("KILN_DIST_POLICY='", v, "': expected abort or shrink");
}

Work::Work(std::string description, Millis timeout)
    : description_(std::move(description)), timeout_(timeout), created_(Clock::now()) {}

WorkState Work::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

std::optional<Work::Clock::time_point> Work::started_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return started_;
}

void Work::start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == WorkState::not_started) {
    state_ = WorkState::in_progress;
    started_ = Clock::now();
  }
}

void Work::complete() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = WorkState::completed;
  }
  cv_.notify_all();
}

void Work::fail(WorkState state, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = state;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

void Work::wait() {
  if (on_wait_ && state() == WorkState::not_started) on_wait_();
  std::unique_lock<std::mutex> lock(mu_);
  const Millis grace = std::chrono::seconds(10);
  while (state_ == WorkState::not_started || state_ == WorkState::in_progress) {
    // Queued work waits for the operations ahead of it, each bounded by its own timeout.
    const auto deadline = started_ ? *started_ + timeout_ + grace : created_ + 4 * timeout_ + grace;
    if (Clock::now() >= deadline) {
      throw CommTimeout(detail::str_cat("Work::wait: ", description_, " did not finish within ",
                                        timeout_.count(), " ms (+10 s grace) of ",
                                        started_ ? "starting" : "being queued", "; its backend did not end it"));
    }
    if (progress_) {
      lock.unlock();
      progress_();  // may complete this Work (and others) under the backend's lock
      lock.lock();
      if (state_ != WorkState::not_started && state_ != WorkState::in_progress) break;
      cv_.wait_for(lock, std::chrono::microseconds(50));
    } else {
      cv_.wait_for(lock, Millis(100));
    }
  }
  if (state_ != WorkState::completed) std::rethrow_exception(error_);
}

void Work::wait_on_device() {
  const WorkState s = state();
  if (device_wait_ && (s == WorkState::not_started || s == WorkState::in_progress) && device_wait_()) return;
  wait();
}

}  // namespace kiln::dist
