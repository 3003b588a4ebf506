// Streams on a machine without a GPU: the registry creates one stream per (device, kind) through
// a fake StreamApi (the communication stream at high priority), StreamGuard sets the current
// stream of one device on one thread and restores it, and a build without CUDA says so.
#include <gtest/gtest.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/stream.h"

using namespace kiln;

namespace {

class FakeStreamApi : public StreamApi {
 public:
  struct Made {
    int device;
    bool high_priority;
  };
  std::vector<Made> streams;
  void* create_stream(int device, bool high_priority) override {
    streams.push_back({device, high_priority});
    return reinterpret_cast<void*>(static_cast<uintptr_t>(0x100 + streams.size()));
  }
  void* create_event(int, bool) override { return nullptr; }
  void destroy_event(void*) override {}
  void record_event(void*, void*) override {}
  void stream_wait_event(void*, void*) override {}
  bool event_done(void*) override { return true; }
  void synchronize_event(void*) override {}
  float elapsed_ms(void*, void*) override { return 0; }
  void synchronize_stream(void*) override {}
};

Device gpu(int i) { return Device(DeviceType::CUDA, i); }
void* handle(uintptr_t v) { return reinterpret_cast<void*>(v); }

}  // namespace

TEST(Streams, RegistryMakesOneStreamPerDeviceAndKind) {
  FakeStreamApi api;
  StreamRegistry reg(&api);
  Stream c0 = reg.get(gpu(0), StreamKind::compute);
  EXPECT_EQ(reg.get(gpu(0), StreamKind::compute), c0);  // created once
  Stream comm0 = reg.get(gpu(0), StreamKind::communication);
  Stream copy0 = reg.get(gpu(0), StreamKind::copy);
  Stream c1 = reg.get(gpu(1), StreamKind::compute);
  EXPECT_FALSE(comm0 == c0);
  EXPECT_FALSE(copy0 == c0);
  EXPECT_FALSE(c1 == c0);
  EXPECT_EQ(c1.device(), gpu(1));
  ASSERT_EQ(api.streams.size(), 4u);
  EXPECT_FALSE(api.streams[0].high_priority);
  EXPECT_TRUE(api.streams[1].high_priority) << "collectives must not wait behind compute";
  EXPECT_FALSE(api.streams[2].high_priority);
  EXPECT_EQ(api.streams[3].device, 1);
  EXPECT_THROW(reg.get(gpu(64), StreamKind::compute), Error);
}

TEST(Streams, RegistryWithoutAnApiSaysBuiltWithoutCuda) {
  StreamRegistry reg(nullptr);
  try {
    reg.get(gpu(0), StreamKind::compute);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
  }
}

TEST(Streams, GuardSetsTheCurrentStreamOfOneDeviceOnOneThread) {
  Stream a = external_stream(gpu(0), handle(0xA));
  Stream b = external_stream(gpu(0), handle(0xB));
  Stream other = external_stream(gpu(1), handle(0xC));
  {
    StreamGuard ga(a);
    EXPECT_EQ(current_stream(gpu(0)), a);
    {
      StreamGuard gb(b);
      StreamGuard go(other);
      EXPECT_EQ(current_stream(gpu(0)), b);
      EXPECT_EQ(current_stream(gpu(1)), other);
      std::thread t([&] {
        // Another thread has its own current streams: with no guard there it would ask the
        // registry (an error in this build), never see this thread's guard.
        StreamGuard gt(other);
        EXPECT_EQ(current_stream(gpu(1)), other);
        StreamGuard gt0(external_stream(gpu(0), handle(0xD)));
        EXPECT_EQ(current_stream(gpu(0)).native(), handle(0xD));
      });
      t.join();
      EXPECT_EQ(current_stream(gpu(0)), b);
    }
    EXPECT_EQ(current_stream(gpu(0)), a);  // the inner guard restored the outer one
    // Device 1's guard is gone: its current stream is the registry's again, which a build
    // without CUDA cannot make.
    if (cuda_stream_api() == nullptr) EXPECT_THROW(current_stream(gpu(1)), Error);
  }
}

TEST(Streams, CpuHasNoStreamAndItsWorkNeedsNoWaits) {
  EXPECT_TRUE(current_stream(Device()).is_cpu());
  EXPECT_TRUE(get_stream(Device(), StreamKind::communication).is_cpu());
  StreamGuard g{Stream()};  // a CPU stream: nothing to set
  synchronize(Stream());
  wait_stream(Stream(), Stream());
  Event e;
  e.record(Stream());
  EXPECT_TRUE(e.query());
  EXPECT_FALSE(e.recorded());
  EXPECT_THROW(external_stream(Device(), handle(1)), Error);
}
