// The progress board: each rank's last started and completed sequence number of a communicator,
// published to the store by the watchdog (only when it changed) and when an operation fails, so
// the rank that times out can name the ranks that never joined the operation.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "kiln/dist/store.h"

namespace kiln::dist {

class ProgressBoard {
 public:
  ProgressBoard(std::shared_ptr<Store> scoped, int rank, int size) : store_(std::move(scoped)), rank_(rank), size_(size) {}
  void started(int64_t seq) { started_ = seq; }
  void completed(int64_t seq) { completed_ = seq; }
  void publish();
  // "rank 1 has not joined it (rank 1 last started #4)", waiting up to `settle` for live peers,
  // which publish when they fail too.
  std::string not_joined(int64_t seq, Millis settle);

 private:
  std::shared_ptr<Store> store_;
  int rank_, size_;
  std::atomic<int64_t> started_{0}, completed_{0};
  int64_t published_started_ = -1, published_completed_ = -1;
};

}  // namespace kiln::dist
