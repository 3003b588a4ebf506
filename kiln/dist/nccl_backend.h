// The NCCL backend (CUDA tensors), host code over kiln's NcclApi / CudaApi (nccl_api.h):
// the unique id through the store under the communicator's name and generation; nonblocking
// communicators, every call polled with ncclCommGetAsyncError until it is not ncclInProgress,
// with a deadline; each operation on the device's communication stream after the caller's
// stream, between a start and an end event; a watchdog (1 s) that starts an operation's clock
// when its start event completes, completes it at its end event, times it out, and polls the
// async error. On a failure: the flight recorder is dumped, a log line names the op and the
// ranks that never joined, then abort (ncclCommAbort, never a destroy after it; the process
// exits 70) or shrink (the survivors agree through the store, then ncclCommShrink with
// NCCL_SHRINK_ABORT where the NCCL has it, else abort and a new communicator under the next
// generation; the Work raises PeerLost carrying it).
#pragma once
#include <memory>
#include <string>

#include "kiln/dist/communicator.h"
#include "kiln/dist/nccl_api.h"
#include "kiln/dist/store.h"

namespace kiln::dist {

struct NcclBackendOptions {
  int device = 0;                          // the CUDA device of this rank
  TensorPlace place = TensorPlace::cuda;   // cpu only for unit tests over fake APIs
  Millis poll_interval{1};                 // between ncclCommGetAsyncError polls
  bool start_watchdog = true;              // tests drive watchdog_tick() themselves
};

class NcclCommunicator;

std::shared_ptr<NcclCommunicator> new_nccl_communicator(std::shared_ptr<NcclApi> nccl, std::shared_ptr<CudaApi> cuda,
                                                        std::shared_ptr<Store> store, int rank, int size,
                                                        const std::string& name, CommOptions options = {},
                                                        NcclBackendOptions backend = {});

class NcclCommunicator : public Communicator {
 public:
  struct Parts;
  NcclCommunicator(std::unique_ptr<Parts> parts);
  ~NcclCommunicator() override;
  int rank() const override;
  int size() const override;
  const std::string& name() const override;
  const char* backend() const override { return "nccl"; }
  Device device() const override;
  int generation() const override;
  WorkPtr all_reduce(const Tensor& t, ReduceOp op, CallOptions o = {}) override;
  WorkPtr all_gather_single(const Tensor& output, const Tensor& input, CallOptions o = {}) override;
  WorkPtr reduce_scatter_single(const Tensor& output, const Tensor& input, ReduceOp op, CallOptions o = {}) override;
  WorkPtr all_to_all_single(const Tensor& output, const Tensor& input, const std::vector<int64_t>& output_splits = {},
                            const std::vector<int64_t>& input_splits = {}, CallOptions o = {}) override;
  WorkPtr broadcast(const Tensor& t, int root, CallOptions o = {}) override;
  WorkPtr send(const Tensor& t, int dst, CallOptions o = {}) override;
  WorkPtr recv(const Tensor& t, int src, CallOptions o = {}) override;
  WorkPtr barrier(CallOptions o = {}) override;
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name) override;
  void abort() override;
  // One watchdog pass (the watchdog thread calls it every interval).
  void watchdog_tick();
  bool aborted() const;
  size_t in_flight() const;

 private:
  std::unique_ptr<Parts> p_;
};

}  // namespace kiln::dist
