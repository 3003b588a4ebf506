// Watchdog: a thread that calls a function every interval (1 s by default) until stopped;
// stop() wakes it at once. Each communicator runs one: it publishes the rank's progress to the
// store (so a peer that times out can say which ranks never joined), writes flight-recorder
// dumps asked for by SIGUSR1, and ends operations their backend failed to end in time.
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace kiln::dist {

class Watchdog {
 public:
  Watchdog(std::chrono::milliseconds interval, std::function<void()> tick)
      : interval_(interval), tick_(std::move(tick)), thread_([this] { run(); }) {}
  ~Watchdog() { stop(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      if (cv_.wait_for(lock, interval_, [this] { return stopping_; })) break;
      lock.unlock();
      try {
        tick_();
      } catch (...) {  // a failed tick (the store gone) must not end the process
      }
      lock.lock();
    }
  }
  std::chrono::milliseconds interval_;
  std::function<void()> tick_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace kiln::dist
