// CachingAllocator on CPU with a scripted fake DeviceMemoryApi: exact counters, reuse without
// system calls in steady state, size bins and best fit, stream separation, empty_cache and
// the out-of-memory path (free the cache, retry once, then kiln::Error naming the size).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>

#include "kiln/core/caching_allocator.h"
#include "kiln/core/error.h"

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
