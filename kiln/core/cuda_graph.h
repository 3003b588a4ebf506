// CudaGraph: a sequence of one device's work captured once and replayed with one launch (the
// role of torch.cuda.CUDAGraph). Between capture_begin and capture_end nothing runs: the kernels
// queued on the device's current stream (core/stream.h), and on the streams that join it through
// events, are recorded into a graph; replay() runs them again, on the same addresses, with the
// values those addresses hold at the time. So:
//   - inputs are tensors made before the capture and kept alive; to replay on new data, copy it
//     into them first (their shapes are fixed: another shape needs another capture);
//   - outputs are the tensors the captured work wrote; keep references to them, since they are
//     overwritten by the next replay;
//   - the memory the captured work allocates and frees comes from the graph's private pool of
//     the caching allocator (NOTE [graph pools] in core/caching_allocator.h) and stays the
//     graph's until it is destroyed;
//   - host values are read once, at capture: a scalar passed to a kernel, a shape, a branch on
//     the host. Work that makes the host wait for the device (item(), synchronize) cannot be
//     captured: capture_end then throws kiln::Error with CUDA's reason, nothing is kept, and the
//     caller runs the work without a graph.
// The capture is in CUDA's relaxed mode (cudaMalloc is allowed in it, for the pool). One capture
// at a time per device. A build without CUDA has the class, and every call says so
// (core/cuda/graph_stub.cpp). The calls are virtual so that a test can stand in for the GPU
// (tests/train/cuda_graphs_test.cpp drives the trainer's StepGraph through a fake).
#pragma once
#include <cstdint>
#include <memory>

#include "kiln/core/device.h"

namespace kiln {

class CudaGraph {
 public:
  CudaGraph();
  virtual ~CudaGraph();  // the graph and its pool's cached memory go back (waits for its replays)
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Starts capturing `device`'s current stream (a CUDA device; not the legacy default stream).
  // A graph captured before is destroyed first. `share_pool_of`: capture into that graph's memory
  // pool (it must be captured already) instead of a new one: the two hold one step's memory
  // between them, which is safe when they are replayed one after the other on one stream, never
  // at once (the pool goes back when both are destroyed).
  virtual void capture_begin(const Device& device, const CudaGraph* share_pool_of = nullptr);
  // Ends the capture and makes the graph ready to replay; kiln::Error (naming CUDA's reason)
  // when the capture failed, the graph then empty and its pool released.
  virtual void capture_end();
  // Ends a capture that an exception interrupted, keeping nothing. A no-op when not capturing.
  virtual void capture_abort() noexcept;
  // Runs the captured work on `device`'s current stream (queued, no host wait).
  virtual void replay();
  virtual bool ready() const;
  // How many kernel and copy nodes the graph holds (0 before a capture).
  virtual int64_t num_nodes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln
