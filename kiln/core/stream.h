// Streams and events: opaque handles over a device's queues of work, the per-thread current
// stream (StreamGuard), and the per-device stream registry (compute, communication and copy
// streams, created on demand with priorities). The system calls go through a StreamApi, which
// the CUDA backend provides (core/cuda/stream_api.cu) and tests replace with a fake; a build
// without CUDA has no StreamApi, and CPU work has no stream (it runs synchronously).
//
// NOTE [current stream]: current_stream(device) is the stream work of `device` should go on
// from this thread: the device's compute stream of this registry unless a StreamGuard on this
// thread names another (the caller's stream in the Python module, a communication stream in
// kiln/dist). It is an execution context carried by the calling thread, as PyTorch's
// getCurrentCUDAStream. The op kernels launch on it (kernels/cuda/context.h's stream(device)),
// kiln/dist's NCCL backend orders its communication streams after it, and the caching
// allocator pools blocks per stream, a block used on another stream returning to its pool only
// after that stream's event (Storage::record_stream; NOTE [deferred frees] in
// core/caching_allocator.h).
#pragma once
#include <cstdint>
#include <memory>

#include "kiln/core/device.h"

namespace kiln {

// The streams kiln creates per device. compute: where ops run by default. communication:
// collectives (high priority, so they are not starved by compute). copy: host/device and
// gather/scatter copies that overlap compute. side: a second compute queue for work that runs
// beside the main one (the fused loss's overlapped weight-gradient products).
enum class StreamKind : uint8_t { compute = 0, communication, copy, side };
inline constexpr int kNumStreamKinds = 4;
const char* stream_kind_name(StreamKind k);

// A stream of a device (a non-owning handle: streams live as long as the process, or, for an
// external stream, as long as whoever made it keeps it). The default Stream is the CPU's.
class Stream {
 public:
  Stream() = default;
  Stream(Device device, void* native) : device_(device), native_(native) {}
  const Device& device() const { return device_; }
  void* native() const { return native_; }  // cudaStream_t on CUDA; nullptr on the CPU
  bool is_cpu() const { return device_.is_cpu(); }
  friend bool operator==(const Stream& a, const Stream& b) {
    return a.device_ == b.device_ && a.native_ == b.native_;
  }

 private:
  Device device_;
  void* native_ = nullptr;
};

// The calls the registry and Event make, per device type (CUDA's in core/cuda/stream_api.cu).
// Handles are opaque. Every call throws kiln::Error on failure.
class StreamApi {
 public:
  virtual ~StreamApi() = default;
  // A non-blocking stream of `device`; `high_priority` maps to the device's greatest priority.
  virtual void* create_stream(int device, bool high_priority) = 0;
  virtual void* create_event(int device, bool timing) = 0;
  virtual void destroy_event(void* event) = 0;
  virtual void record_event(void* event, void* stream) = 0;
  virtual void stream_wait_event(void* stream, void* event) = 0;  // no host wait
  virtual bool event_done(void* event) = 0;                       // no host wait
  virtual void synchronize_event(void* event) = 0;
  virtual float elapsed_ms(void* start, void* stop) = 0;
  virtual void synchronize_stream(void* stream) = 0;
};

// The CUDA backend's StreamApi; nullptr in a build without CUDA (core/cuda/runtime_stub.cpp).
StreamApi* cuda_stream_api();

// The stream registry of one device type: one stream per (device, kind), created on first use
// through `api` and never destroyed (NOTE [CUDA registry] in core/cuda/runtime.h says why).
class StreamRegistry {
 public:
  explicit StreamRegistry(StreamApi* api);
  ~StreamRegistry();
  StreamRegistry(const StreamRegistry&) = delete;
  StreamRegistry& operator=(const StreamRegistry&) = delete;

  Stream get(const Device& device, StreamKind kind);
  StreamApi* api() const { return api_; }

 private:
  struct Slots;
  StreamApi* api_;
  std::unique_ptr<Slots> slots_;
};

// The process-wide registry of CUDA streams (over cuda_stream_api()). In a build without CUDA
// asking it for a stream is an error that says so.
StreamRegistry& cuda_streams();

// The stream of `kind` on `device`: the CPU stream for a CPU device.
Stream get_stream(const Device& device, StreamKind kind);
// The stream kernels of `device` launch on from this thread (NOTE [current stream]).
Stream current_stream(const Device& device);
// A stream kiln did not create (the caller's: torch.cuda.current_stream().cuda_stream), for a
// StreamGuard. nullptr names the device's legacy default stream.
Stream external_stream(const Device& device, void* native);

// Makes `stream` the current stream of its device on this thread for the guard's scope
// (nested guards restore the previous one; other devices and threads are unaffected).
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Device device_;
  bool had_previous_ = false;
  Stream previous_;
};

// Blocks the host until all work queued on `stream` is done (no-op for the CPU).
void synchronize(const Stream& stream);
// Makes `waiter` wait (on the device, not the host) for all work queued on `producer` so far.
void wait_stream(const Stream& waiter, const Stream& producer);

// An event of one device: recorded on a stream, waited for by other streams or the host. Owns
// its handle (move-only). Created lazily at the first record.
class Event {
 public:
  Event() = default;
  explicit Event(bool timing) : timing_(timing) {}
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const Stream& stream);
  void wait(const Stream& stream) const;  // `stream` waits for the recorded work (device side)
  bool query() const;                     // done (an event never recorded is done)
  void synchronize() const;               // host wait
  float elapsed_ms(const Event& stop) const;  // both recorded, timing events
  bool recorded() const { return native_ != nullptr; }
  const Device& device() const { return device_; }  // of the stream it was last recorded on

 private:
  void reset() noexcept;
  StreamApi* api_ = nullptr;
  void* native_ = nullptr;
  Device device_;
  bool timing_ = false;
};

}  // namespace kiln
