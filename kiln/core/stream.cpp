// Stream registry, current stream per thread, StreamGuard and Event (design in stream.h).
#include "kiln/core/stream.h"

#include <array>
#include <mutex>
#include <utility>
#include <vector>

#include "kiln/core/error.h"

namespace kiln {

const char* stream_kind_name(StreamKind k) {
  switch (k) {
    case StreamKind::compute: return "compute";
    case StreamKind::communication: return "communication";
    case StreamKind::copy: return "copy";
    case StreamKind::side: return "side";
  }
  return "?";
}

namespace {

constexpr int kMaxDevices = 64;

void check_device(const Device& d, const char* what) {
  KILN_CHECK(d.index >= 0 && d.index < kMaxDevices, what, ": device index ", d.index, " out of range [0, ",
             kMaxDevices, ")");
}

// NOTE [current stream] (stream.h): the overrides of this thread, one per CUDA device index.
struct ThreadStreams {
  std::array<Stream, kMaxDevices> current{};
  std::array<bool, kMaxDevices> set{};
};
ThreadStreams& thread_streams() {
  thread_local ThreadStreams t;
  return t;
}

StreamApi* api_for(const Device& d, const char* what) {
  KILN_CHECK(d.is_cuda(), what, ": no streams on ", d.str());
  StreamApi* api = cuda_streams().api();
  KILN_CHECK(api != nullptr, what, ": kiln was built without CUDA (", d.str(), " has no streams here)");
  return api;
}

}  // namespace

struct StreamRegistry::Slots {
  std::mutex mu;
  std::array<std::array<void*, kNumStreamKinds>, kMaxDevices> native{};
};

StreamRegistry::StreamRegistry(StreamApi* api) : api_(api), slots_(std::make_unique<Slots>()) {}
StreamRegistry::~StreamRegistry() = default;

Stream StreamRegistry::get(const Device& device, StreamKind kind) {
  check_device(device, "get_stream");
  KILN_CHECK(api_ != nullptr, "get_stream(", device.str(), ", ", stream_kind_name(kind),
             "): kiln was built without CUDA");
  std::lock_guard<std::mutex> lock(slots_->mu);
  void*& s = slots_->native[static_cast<size_t>(device.index)][static_cast<size_t>(kind)];
  if (!s) s = api_->create_stream(device.index, kind == StreamKind::communication);
  return Stream(device, s);
}

StreamRegistry& cuda_streams() {
  // NOTE [CUDA registry]: process-wide because the GPUs are; never destroyed.
  static auto* registry = new StreamRegistry(cuda_stream_api());
  return *registry;
}

Stream get_stream(const Device& device, StreamKind kind) {
  if (device.is_cpu()) return Stream();
  return cuda_streams().get(device, kind);
}

Stream current_stream(const Device& device) {
  if (device.is_cpu()) return Stream();
  check_device(device, "current_stream");
  ThreadStreams& t = thread_streams();
  const size_t i = static_cast<size_t>(device.index);
  if (t.set[i]) return t.current[i];
  return cuda_streams().get(device, StreamKind::compute);
}

Stream external_stream(const Device& device, void* native) {
  KILN_CHECK(device.is_cuda(), "external_stream: streams belong to CUDA devices, not ", device.str());
  check_device(device, "external_stream");
  return Stream(device, native);
}

StreamGuard::StreamGuard(const Stream& stream) : device_(stream.device()) {
  if (device_.is_cpu()) return;
  check_device(device_, "StreamGuard");
  ThreadStreams& t = thread_streams();
  const size_t i = static_cast<size_t>(device_.index);
  had_previous_ = t.set[i];
  previous_ = t.current[i];
  t.current[i] = stream;
  t.set[i] = true;
}

StreamGuard::~StreamGuard() {
  if (device_.is_cpu()) return;
  ThreadStreams& t = thread_streams();
  const size_t i = static_cast<size_t>(device_.index);
  t.current[i] = previous_;
  t.set[i] = had_previous_;
}

void synchronize(const Stream& stream) {
  if (stream.is_cpu()) return;
  api_for(stream.device(), "synchronize")->synchronize_stream(stream.native());
}

void wait_stream(const Stream& waiter, const Stream& producer) {
  if (waiter.is_cpu() || producer.is_cpu() || waiter == producer) return;
  Event e;
  e.record(producer);
  e.wait(waiter);
}

Event::~Event() { reset(); }

Event::Event(Event&& o) noexcept
    : api_(std::exchange(o.api_, nullptr)), native_(std::exchange(o.native_, nullptr)), device_(o.device_),
      timing_(o.timing_) {}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    reset();
    api_ = std::exchange(o.api_, nullptr);
    native_ = std::exchange(o.native_, nullptr);
    device_ = o.device_;
    timing_ = o.timing_;
  }
  return *this;
}

void Event::reset() noexcept {
  if (native_ && api_) {
    try {
      api_->destroy_event(native_);
    } catch (...) {  // a destructor must not throw; the handle is lost at worst
    }
  }
  native_ = nullptr;
}

void Event::record(const Stream& stream) {
  if (stream.is_cpu()) {  // CPU work is done when it returns: nothing to record
    reset();
    device_ = stream.device();
    return;
  }
  KILN_CHECK(!native_ || device_ == stream.device(), "Event::record: the event belongs to ", device_.str(),
             ", the stream to ", stream.device().str());
  if (!native_) {
    api_ = api_for(stream.device(), "Event::record");
    device_ = stream.device();
    native_ = api_->create_event(device_.index, timing_);
  }
  api_->record_event(native_, stream.native());
}

void Event::wait(const Stream& stream) const {
  if (!native_ || stream.is_cpu()) return;
  api_->stream_wait_event(stream.native(), native_);
}

bool Event::query() const { return !native_ || api_->event_done(native_); }

void Event::synchronize() const {
  if (native_) api_->synchronize_event(native_);
}

float Event::elapsed_ms(const Event& stop) const {
  KILN_CHECK(native_ && stop.native_, "Event::elapsed_ms: both events must have been recorded on a device");
  KILN_CHECK(timing_ && stop.timing_, "Event::elapsed_ms: both events must be timing events (Event(true))");
  return api_->elapsed_ms(native_, stop.native_);
}

}  // namespace kiln
