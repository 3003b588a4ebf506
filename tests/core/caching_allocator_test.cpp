// CachingAllocator on CPU with a scripted fake DeviceMemoryApi: exact counters, reuse without
// system calls in steady state, size bins and best fit, stream separation, empty_cache, the
// out-of-memory path (free the cache, retry once, then kiln::Error naming the size), and
// deferred frees of blocks used on a second stream (events the test completes by hand), and the
// private pools of graph captures.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kiln/core/caching_allocator.h"
#include "kiln/core/error.h"
#include "kiln/core/storage.h"
#include "kiln/core/stream.h"

using namespace kiln;

namespace {
// Hands out real host memory, records every call, and can be limited to `capacity` bytes.
class FakeApi : public DeviceMemoryApi {
 public:
  size_t capacity = SIZE_MAX;
  size_t held = 0;
  int mallocs = 0, frees = 0, failed = 0;
  void* stream = nullptr;
  std::vector<size_t> sizes;  // sizes passed to malloc
  std::set<void*> live;
  std::vector<std::pair<void*, size_t>> blocks;

  void* malloc(size_t n) override {
    if (held + n > capacity) {
      ++failed;
      return nullptr;
    }
    void* p = std::malloc(n);
    ++mallocs;
    held += n;
    sizes.push_back(n);
    live.insert(p);
    blocks.emplace_back(p, n);
    return p;
  }
  void free(void* p) override {
    EXPECT_TRUE(live.count(p)) << "free of a pointer not from malloc (or freed twice)";
    live.erase(p);
    for (auto& [q, n] : blocks)
      if (q == p) held -= n, n = 0;
    ++frees;
    std::free(p);
  }
  void* current_stream() override { return stream; }
  void memset(void* p, uint8_t byte, size_t n, void* on_stream) override {
    EXPECT_TRUE(live.count(p)) << "memset of a pointer not from malloc";
    fill_streams.push_back(on_stream);
    std::memset(p, byte, n);
  }
  std::vector<void*> fill_streams;  // the stream of each memset

  // Events: each recorded event is a slot the test completes by hand (complete_all, or
  // done[i] = true); synchronize_event completes it, as a host wait would.
  struct FakeEvent {
    void* stream;
    bool done = false, released = false;
    int syncs = 0;
  };
  std::vector<FakeEvent> events;
  void* record_event(void* on_stream) override {
    events.push_back(FakeEvent{on_stream});
    return reinterpret_cast<void*>(events.size());  // 1-based: never nullptr
  }
  FakeEvent& event(void* e) {
    const size_t i = reinterpret_cast<size_t>(e) - 1;
    EXPECT_LT(i, events.size());
    EXPECT_FALSE(events[i].released) << "event used after release";
    return events[i];
  }
  bool event_done(void* e) override { return event(e).done; }
  void synchronize_event(void* e) override {
    FakeEvent& f = event(e);
    ++f.syncs;
    f.done = true;
  }
  void release_event(void* e) override { event(e).released = true; }
  void complete_all() {
    for (auto& e : events) e.done = true;
  }
  int unreleased() const {
    int n = 0;
    for (auto& e : events) n += e.released ? 0 : 1;
    return n;
  }
  // The fake device goes away with its memory: blocks a test left allocated are released here.
  ~FakeApi() override {
    for (void* p : live) std::free(p);
  }
};
}  // namespace

TEST(CachingAllocator, RoundsTo512AndCountsRequestedBytes) {
  FakeApi api;
  {
    CachingAllocator a(&api, "fake");
    void* p = a.allocate(1000);
    void* q = a.allocate(1);
    void* z = a.allocate(0);
    EXPECT_EQ(api.sizes, (std::vector<size_t>{1024, 512, 512}));
    MemoryStats s = a.stats();
    EXPECT_EQ(s.current_bytes, 1001);
    EXPECT_EQ(s.peak_bytes, 1001);
    EXPECT_EQ(s.reserved_bytes, 2048);
    EXPECT_EQ(s.num_allocs, 3);
    EXPECT_EQ(s.num_system_allocs, 3);
    a.deallocate(p, 1000);
    s = a.stats();
    EXPECT_EQ(s.current_bytes, 1);
    EXPECT_EQ(s.peak_bytes, 1001);
    EXPECT_EQ(s.reserved_bytes, 2048);  // cached, still held
    EXPECT_EQ(a.cached_bytes(), 1024);
    a.reset_peak();
    EXPECT_EQ(a.stats().peak_bytes, 1);
    a.deallocate(q, 1);
    a.deallocate(z, 0);
    EXPECT_EQ(a.stats().current_bytes, 0);
  }
  EXPECT_EQ(api.frees, 3);  // the destructor returns the cache
  EXPECT_TRUE(api.live.empty());
}

TEST(CachingAllocator, SteadyStateMakesNoSystemAllocations) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  const std::vector<size_t> step = {4096, 100, 3 << 20, 777, 5 << 20, 1 << 19};
  for (int it = 0; it < 50; ++it) {
    std::vector<std::pair<void*, size_t>> ps;
    for (size_t n : step) ps.emplace_back(a.allocate(n), n);
    for (auto& [p, n] : ps) a.deallocate(p, n);
  }
  EXPECT_EQ(api.mallocs, static_cast<int>(step.size()));
  MemoryStats s = a.stats();
  EXPECT_EQ(s.num_system_allocs, static_cast<int64_t>(step.size()));
  EXPECT_EQ(s.num_allocs, 50 * static_cast<int64_t>(step.size()));
  EXPECT_EQ(s.current_bytes, 0);
  int64_t total = 0;
  for (size_t n : step) total += static_cast<int64_t>(n);
  EXPECT_EQ(s.peak_bytes, total);
  int64_t rounded = 0;
  for (size_t n : step) rounded += static_cast<int64_t>(CachingAllocator::round_size(n));
  EXPECT_EQ(s.reserved_bytes, rounded);
}

TEST(CachingAllocator, SmallBinsAreExactLargeIsBestFit) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  void* small = a.allocate(2048);
  a.deallocate(small, 2048);
  void* other = a.allocate(1024);  // a different small bin: no reuse of the 2048 block
  EXPECT_NE(other, small);
  EXPECT_EQ(api.mallocs, 2);
  void* again = a.allocate(1800);  // rounds to 2048: reuses the cached block
  EXPECT_EQ(again, small);
  EXPECT_EQ(api.mallocs, 2);

  void* big8 = a.allocate(8 << 20);
  void* big4 = a.allocate(4 << 20);
  a.deallocate(big8, 8 << 20);
  a.deallocate(big4, 4 << 20);
  EXPECT_EQ(a.allocate((4 << 20) - 4096), big4);  // best fit: the smaller block that fits
  EXPECT_EQ(api.mallocs, 4);
  void* fresh = a.allocate(2 << 20);  // the 8 MiB block would waste too much: new allocation
  EXPECT_NE(fresh, big8);
  EXPECT_EQ(api.mallocs, 5);
  EXPECT_EQ(a.allocate(8 << 20), big8);
  EXPECT_EQ(api.mallocs, 5);
}

TEST(CachingAllocator, BlocksAreReusedOnlyOnTheirStream) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  int s1 = 0, s2 = 0;
  api.stream = &s1;
  void* p = a.allocate(4096);
  a.deallocate(p, 4096);
  api.stream = &s2;
  void* q = a.allocate(4096);
  EXPECT_NE(p, q);
  EXPECT_EQ(api.mallocs, 2);
  api.stream = &s1;
  EXPECT_EQ(a.allocate(4096), p);
  EXPECT_EQ(api.mallocs, 2);
}

TEST(CachingAllocator, EmptyCacheReturnsOnlyCachedBlocks) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  void* p = a.allocate(3 << 20);
  void* q = a.allocate(5000);
  a.deallocate(p, 3 << 20);
  EXPECT_EQ(a.stats().reserved_bytes, (3 << 20) + 5120);
  a.empty_cache();
  EXPECT_EQ(api.frees, 1);
  EXPECT_EQ(a.stats().reserved_bytes, 5120);
  EXPECT_EQ(a.stats().current_bytes, 5000);
  EXPECT_EQ(a.cached_bytes(), 0);
  a.deallocate(q, 5000);
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes, 0);
  EXPECT_TRUE(api.live.empty());
}

TEST(CachingAllocator, OutOfMemoryFreesCacheAndRetriesOnce) {
  FakeApi api;
  api.capacity = 10 << 20;
  CachingAllocator a(&api, "fake");
  void* p = a.allocate(6 << 20);
  a.deallocate(p, 6 << 20);  // 6 MiB cached
  void* q = a.allocate(3 << 20);  // the 6 MiB block would waste too much: a new block
  EXPECT_EQ(api.failed, 0);
  a.deallocate(q, 3 << 20);
  // 7 MiB fits no cached block and not beside them (6 + 3 + 7 > 10): the cache must go.
  void* r = a.allocate(7 << 20);
  EXPECT_EQ(api.failed, 1);  // first try failed, the retry after freeing the cache succeeded
  EXPECT_EQ(api.frees, 2);
  EXPECT_EQ(a.stats().reserved_bytes, 7 << 20);
  try {
    a.allocate(4 << 20);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("out of memory"), std::string::npos) << msg;
    EXPECT_NE(msg.find("4194304"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fake"), std::string::npos) << msg;
  }
  EXPECT_EQ(api.failed, 3);  // one try and one retry
  MemoryStats s = a.stats();
  EXPECT_EQ(s.current_bytes, 7 << 20);
  EXPECT_EQ(s.num_allocs, 3);
  a.deallocate(r, 7 << 20);
}

TEST(CachingAllocator, RejectsForeignPointers) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  int x = 0;
  EXPECT_THROW(a.deallocate(&x, 4), Error);
}

TEST(CachingAllocator, FillRunsOnTheBlocksStreamAndOnlyOnItsBlocks) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  int tag = 0;
  api.stream = &tag;
  auto* p = static_cast<unsigned char*>(a.allocate(1000));
  api.stream = nullptr;  // the block keeps the stream it was allocated for
  a.fill(p, 1000, 0xAB);
  ASSERT_EQ(api.fill_streams.size(), 1u);
  EXPECT_EQ(api.fill_streams[0], &tag);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(p[i], 0xAB);
  EXPECT_THROW(a.fill(p, 1025, 0), Error);  // past the 1024-byte block
  int other = 0;
  EXPECT_THROW(a.fill(&other, 4, 0), Error);
  a.deallocate(p, 1000);
  EXPECT_THROW(a.fill(p, 4, 0), Error);  // cached, not live
}

namespace {
Stream fake_stream(int& tag) { return Stream(Device(DeviceType::CUDA, 0), &tag); }
}  // namespace

TEST(CachingAllocator, ABlockReadOnAnotherStreamIsNotReusedBeforeItsEvent) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  int compute = 0, comm = 0;
  api.stream = &compute;
  void* p = a.allocate(4096);
  a.record_stream(p, fake_stream(comm));  // comm still reads p after the owner frees it
  a.deallocate(p, 4096);
  ASSERT_EQ(api.events.size(), 1u);
  EXPECT_EQ(api.events[0].stream, &comm);  // the event is recorded on the reading stream
  EXPECT_EQ(a.pending_bytes(), 4096);
  EXPECT_EQ(a.cached_bytes(), 4096);
  MemoryStats s = a.stats();
  EXPECT_EQ(s.current_bytes, 0);  // a pending block is not live
  EXPECT_EQ(s.reserved_bytes, 4096);

  // The same size on the same stream while comm's work is queued: a fresh block.
  void* q = a.allocate(4096);
  EXPECT_NE(q, p);
  EXPECT_EQ(api.mallocs, 2);
  EXPECT_EQ(api.events[0].syncs, 0);  // allocate never waits on the host
  EXPECT_FALSE(api.events[0].released);

  api.events[0].done = true;  // comm's reads are done
  void* r = a.allocate(4096);
  EXPECT_EQ(r, p);  // back in compute's pool, reused without a system call
  EXPECT_EQ(api.mallocs, 2);
  EXPECT_TRUE(api.events[0].released);
  EXPECT_EQ(a.pending_bytes(), 0);
  s = a.stats();
  EXPECT_EQ(s.current_bytes, 8192);
  EXPECT_EQ(s.peak_bytes, 8192);
  EXPECT_EQ(s.reserved_bytes, 8192);
  EXPECT_EQ(s.num_allocs, 3);
  EXPECT_EQ(s.num_system_allocs, 2);
  a.deallocate(q, 4096);
  a.deallocate(r, 4096);
  EXPECT_EQ(api.events.size(), 1u);  // no stream use recorded: no event
  EXPECT_EQ(a.cached_bytes(), 8192);
  EXPECT_EQ(a.pending_bytes(), 0);
}

TEST(CachingAllocator, ABlockWaitsForEveryStreamThatUsedIt) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  int compute = 0, comm = 0, copy = 0;
  api.stream = &compute;
  const size_t n = (3 << 20) + 1;  // a large block: best-fit path
  void* p = a.allocate(n);
  a.record_stream(p, fake_stream(comm));
  a.record_stream(p, fake_stream(copy));
  a.record_stream(p, fake_stream(comm));     // named twice: one event
  a.record_stream(p, fake_stream(compute));  // its own stream: nothing to wait for
  a.deallocate(p, n);
  ASSERT_EQ(api.events.size(), 2u);
  EXPECT_EQ(api.events[0].stream, &comm);
  EXPECT_EQ(api.events[1].stream, &copy);
  api.events[1].done = true;  // copy done, comm not yet
  void* q = a.allocate(n);
  EXPECT_NE(q, p);
  EXPECT_TRUE(api.events[1].released);
  EXPECT_FALSE(api.events[0].released);
  EXPECT_EQ(a.pending_bytes(), static_cast<int64_t>(CachingAllocator::round_size(n)));
  api.events[0].done = true;
  EXPECT_EQ(a.allocate(n), p);
  EXPECT_EQ(api.unreleased(), 0);
  EXPECT_EQ(api.mallocs, 2);
  // Another stream never takes the block, pending or not.
  a.deallocate(p, n);
  api.stream = &comm;
  void* other = a.allocate(n);
  EXPECT_NE(other, p);
  EXPECT_EQ(api.mallocs, 3);
  a.deallocate(other, n);
  a.deallocate(q, n);
}

TEST(CachingAllocator, EmptyCacheAndOutOfMemoryWaitForPendingBlocks) {
  FakeApi api;
  api.capacity = 8 << 20;
  CachingAllocator a(&api, "fake");
  int compute = 0, comm = 0;
  api.stream = &compute;
  void* p = a.allocate(5 << 20);
  a.record_stream(p, fake_stream(comm));
  a.deallocate(p, 5 << 20);
  // 5 MiB more does not fit beside the pending block: the retry waits for its event, returns
  // it to the system and succeeds.
  void* q = a.allocate(5 << 20);
  EXPECT_EQ(api.failed, 1);
  EXPECT_EQ(api.events[0].syncs, 1);
  EXPECT_TRUE(api.events[0].released);
  EXPECT_EQ(api.frees, 1);
  EXPECT_EQ(a.pending_bytes(), 0);
  EXPECT_EQ(a.stats().reserved_bytes, 5 << 20);

  a.record_stream(q, fake_stream(comm));
  a.deallocate(q, 5 << 20);
  a.empty_cache();  // waits for comm, then frees
  EXPECT_EQ(api.events[1].syncs, 1);
  EXPECT_EQ(api.unreleased(), 0);
  EXPECT_EQ(a.stats().reserved_bytes, 0);
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_TRUE(api.live.empty());

  void* r = a.allocate(1000);
  a.record_stream(r, fake_stream(comm));
  a.deallocate(r, 1000);
  EXPECT_THROW(a.record_stream(r, fake_stream(comm)), Error);  // freed: not live any more
  int x = 0;
  EXPECT_THROW(a.record_stream(&x, fake_stream(comm)), Error);
}

TEST(CachingAllocator, DestructorWaitsForPendingBlocks) {
  FakeApi api;
  int compute = 0, comm = 0;
  api.stream = &compute;
  {
    CachingAllocator a(&api, "fake");
    void* p = a.allocate(2048);
    a.record_stream(p, fake_stream(comm));
    a.deallocate(p, 2048);
  }
  ASSERT_EQ(api.events.size(), 1u);
  EXPECT_EQ(api.events[0].syncs, 1);
  EXPECT_TRUE(api.events[0].released);
  EXPECT_TRUE(api.live.empty());
}

TEST(CachingAllocator, RandomStreamUsesNeverHandOutABlockBeforeItsEvents) {
  // Fresh random schedule: blocks on two streams, some read by the other, events completed in
  // random order; a block handed out must have no event of an earlier use still incomplete.
  FakeApi api;
  CachingAllocator a(&api, "fake");
  int s0 = 0, s1 = 0;
  std::random_device rd;
  const unsigned seed = rd();
  std::mt19937 rng(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<std::pair<void*, size_t>> live;
  std::map<void*, std::vector<size_t>> waits;  // block -> its events not seen complete
  int64_t requested = 0;
  for (int step = 0; step < 2000; ++step) {
    const int op = static_cast<int>(rng() % 4);
    api.stream = rng() % 2 ? &s0 : &s1;
    if (op <= 1 || live.empty()) {
      const size_t n = (rng() % 4 + 1) * 700;
      void* p = a.allocate(n);
      for (size_t e : waits[p]) ASSERT_TRUE(api.events[e].done) << "block reused before event " << e;
      waits.erase(p);
      live.emplace_back(p, n);
      requested += static_cast<int64_t>(n);
    } else if (op == 2) {
      const size_t i = rng() % live.size();
      auto [p, n] = live[i];
      if (rng() % 2) a.record_stream(p, fake_stream(rng() % 2 ? s0 : s1));
      const size_t before = api.events.size();
      a.deallocate(p, n);
      for (size_t e = before; e < api.events.size(); ++e) waits[p].push_back(e);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      requested -= static_cast<int64_t>(n);
    } else if (!api.events.empty()) {
      api.events[rng() % api.events.size()].done = true;
    }
    ASSERT_EQ(a.stats().current_bytes, requested);
  }
  for (auto& [p, n] : live) a.deallocate(p, n);
  a.empty_cache();
  EXPECT_EQ(api.unreleased(), 0);
  EXPECT_EQ(a.stats().reserved_bytes, 0);
  EXPECT_EQ(a.stats().current_bytes, 0);
  EXPECT_TRUE(api.live.empty());
}

// NOTE [graph pools]: a capture allocates from its own pool, adopts what it frees, keeps what it
// used out of the allocator's pools after it ends, and gives it back only at release_pool.
TEST(CachingAllocator, ACaptureAllocatesFromItsOwnPoolAndKeepsItsBlocks) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  int compute = 0;
  api.stream = &compute;
  void* before = a.allocate(4096);  // an eager tensor read by the captured work, freed in the capture
  void* cached = a.allocate(8192);
  a.deallocate(cached, 8192);  // cached in the allocator's own pool
  a.begin_allocate_to_pool(7);
  EXPECT_THROW(a.begin_allocate_to_pool(8), Error);  // one capture at a time
  void* x = a.allocate(8192);
  EXPECT_NE(x, cached);  // the own pool's block is not taken: the graph's memory is its own
  EXPECT_EQ(api.mallocs, 3);
  a.deallocate(x, 8192);
  void* y = a.allocate(8192);
  EXPECT_EQ(y, x);  // freed within the capture: reused in capture order, as the replay runs
  a.deallocate(before, 4096);  // adopted by the graph: replays read it
  void* z = a.allocate(4096);
  EXPECT_EQ(z, before);
  a.deallocate(z, 4096);
  a.end_allocate_to_pool();
  EXPECT_EQ(a.pool_cached_bytes(7), 4096);  // z's block; y is live (an output of the graph)
  EXPECT_EQ(a.pool_cached_bytes(0), 8192);

  // After the capture, eager work takes neither the graph's cached blocks nor its freed outputs.
  void* e1 = a.allocate(4096);
  EXPECT_NE(e1, before);
  a.deallocate(y, 8192);  // the graph's output dropped: back to the graph's pool
  void* e2 = a.allocate(8192);
  EXPECT_EQ(e2, cached);
  void* e3 = a.allocate(8192);
  EXPECT_NE(e3, y);
  EXPECT_EQ(a.pool_cached_bytes(7), 4096 + 8192);
  a.empty_cache();  // leaves the graph's pool alone
  EXPECT_EQ(a.pool_cached_bytes(7), 4096 + 8192);
  EXPECT_TRUE(api.live.count(y) && api.live.count(before));

  // A second capture into the same pool takes its blocks again.
  a.begin_allocate_to_pool(7);
  void* w = a.allocate(8192);
  EXPECT_EQ(w, y);
  a.end_allocate_to_pool();
  EXPECT_THROW(a.release_pool(0), Error);
  a.release_pool(7);
  EXPECT_FALSE(api.live.count(before));  // the pool's cached block went back to the system
  EXPECT_TRUE(api.live.count(w));        // its live one is the caller's ...
  a.deallocate(w, 8192);                 // ... and, freed, joins the allocator's own pool
  EXPECT_EQ(a.pool_cached_bytes(0), 8192);
  EXPECT_EQ(a.pool_cached_bytes(7), 0);
  void* again = a.allocate(8192);
  EXPECT_EQ(again, w);
  for (void* p : {e1, e2, e3, again}) a.deallocate(p, 1);
  const MemoryStats s = a.stats();
  EXPECT_EQ(s.current_bytes, 0);
  EXPECT_EQ(s.reserved_bytes, static_cast<int64_t>(api.held));
}

// During a capture no event is recorded (CUDA refuses to query one recorded while capturing): a
// block another stream used is kept from reuse until the capture ends, then joins the pool.
TEST(CachingAllocator, ACaptureDefersBlocksOtherStreamsUsedToItsEnd) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  int compute = 0, side = 0;
  api.stream = &compute;
  a.begin_allocate_to_pool(3);
  void* p = a.allocate(1 << 20);
  a.record_stream(p, fake_stream(side));
  a.deallocate(p, 1 << 20);
  EXPECT_TRUE(api.events.empty());
  void* q = a.allocate(1 << 20);
  EXPECT_NE(q, p);  // the side branch of the graph may still read p
  EXPECT_EQ(a.pool_cached_bytes(3), 1 << 20);
  EXPECT_EQ(a.pending_bytes(), 1 << 20);
  a.deallocate(q, 1 << 20);
  a.end_allocate_to_pool();
  EXPECT_EQ(a.pending_bytes(), 0);
  EXPECT_EQ(a.pool_cached_bytes(3), 2 << 20);
  EXPECT_TRUE(api.events.empty());
  a.begin_allocate_to_pool(3);
  void* r1 = a.allocate(1 << 20);
  void* r2 = a.allocate(1 << 20);
  EXPECT_TRUE((r1 == p && r2 == q) || (r1 == q && r2 == p));
  a.end_allocate_to_pool();
  a.deallocate(r1, 1);
  a.deallocate(r2, 1);
  EXPECT_EQ(api.mallocs, 2);
}

// Out of memory while a graph is captured: an error that says so, and the cache kept (freeing
// it would wait for the device, which breaks a capture).
TEST(CachingAllocator, OutOfMemoryDuringACaptureKeepsTheCache) {
  FakeApi api;
  api.capacity = 3 << 20;
  CachingAllocator a(&api, "fake");
  void* cached = a.allocate(2 << 20);
  a.deallocate(cached, 2 << 20);
  a.begin_allocate_to_pool(5);
  std::string msg;
  try {
    a.allocate(2 << 20);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("out of memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("while a CUDA graph was captured"), std::string::npos) << msg;
  EXPECT_EQ(api.frees, 0);
  a.end_allocate_to_pool();
  void* again = a.allocate(2 << 20);  // outside the capture the cached block serves it
  EXPECT_EQ(again, cached);
  a.deallocate(again, 1);
}

// A block of another graph's pool, freed while a second graph is captured, stays the first
// graph's (it writes that address at its replays); released, the first pool gives it back.
TEST(CachingAllocator, ABlockOfAnotherOpenGraphPoolStaysItsOwn) {
  FakeApi api;
  CachingAllocator a(&api, "fake");
  a.begin_allocate_to_pool(1);
  void* out1 = a.allocate(4096);  // an output of graph 1, still held
  a.end_allocate_to_pool();
  a.begin_allocate_to_pool(2);
  a.deallocate(out1, 4096);  // dropped during graph 2's capture
  void* x = a.allocate(4096);
  EXPECT_NE(x, out1);  // graph 2 does not take graph 1's block
  a.deallocate(x, 4096);
  a.end_allocate_to_pool();
  EXPECT_EQ(a.pool_cached_bytes(1), 4096);
  EXPECT_EQ(a.pool_cached_bytes(2), 4096);
  a.release_pool(1);
  EXPECT_FALSE(api.live.count(out1));
  EXPECT_TRUE(api.live.count(x));
}

TEST(CachingAllocator, StorageRecordStreamChecksTheDevice) {
  Storage cpu(64, Device());
  EXPECT_NO_THROW(cpu.record_stream(Stream()));  // CPU memory is used synchronously: nothing to defer
  int tag = 0;
  try {
    cpu.record_stream(fake_stream(tag));
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cpu"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cuda:0"), std::string::npos) << msg;
  }
}
