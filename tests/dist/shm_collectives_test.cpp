// ShmCollectives with threads as ranks of one process (each maps the segment on its own, as
// processes do): all_reduce and reduce_scatter against the rank-order reduction, bit for bit, and
// all_gather (also in place) against the inputs, over step counts,
// uneven parts and world sizes 2 to 4, within a time that a lost futex wake-up would exceed; and
// its fault paths through a ShmApi whose calls fail or whose peers are gone: every rank left
// without a segment (with the reason) when one cannot create, map or share it or rank 0 fails
// setting it up, nothing left in /dev/shm when a peer never answers, a gone peer ending a wait at
// once (but not one that already arrived), a late one timing out naming it, abort_peers and
// left() ending the others' waits, and ranks calling with different sizes or ops failing instead
// of mixing data.
#include "kiln/dist/shm_collectives.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "tests/dist/dist_test_util.h"

namespace kiln::dist {
namespace {

using test::contains;
using Clock = std::chrono::steady_clock;
constexpr uint32_t kSum = 1;  // the caller's kind tag

// The system's calls, each replaceable.
struct FakeShm : ShmApi {
  std::function<void(const std::string&)> before_create, before_open;
  std::function<bool(int)> alive_fn;
  void* create(const std::string& name, size_t bytes) override {
    if (before_create) before_create(name);
    return system_shm_api().create(name, bytes);
  }
  void* open(const std::string& name, size_t bytes) override {
    if (before_open) before_open(name);
    return system_shm_api().open(name, bytes);
  }
  void unmap(void* p, size_t bytes) override { system_shm_api().unmap(p, bytes); }
  void unlink(const std::string& name) override { system_shm_api().unlink(name); }
  bool alive(int pid) override { return alive_fn ? alive_fn(pid) : system_shm_api().alive(pid); }
};

struct World {
  test::LocalStore local{"shm-test"};
  std::vector<std::unique_ptr<ShmCollectives>> ranks;
  std::vector<std::string> why;
  // Connects `size` ranks (one thread each) under a fresh prefix; host_of(r) as their host ids.
  World(int size, ShmApi& api, size_t chunk, const std::function<std::string(int)>& host_of = nullptr,
        Millis store_timeout = Millis(20000), const std::function<int(int)>& pid_of = nullptr) {
    ranks.resize(static_cast<size_t>(size));
    why.resize(static_cast<size_t>(size));
    static int prefix = 0;
    const std::string p = "w" + std::to_string(prefix++);
    std::vector<std::thread> th;
    for (int r = 0; r < size; ++r)
      th.emplace_back([&, r] {
        // A client per rank: a client's blocking get holds its connection.
        PrefixStore store(p, std::make_shared<TcpStore>("127.0.0.1", local.server->port(), "shm-test"));
        store.set_timeout(store_timeout);
        ShmCollectives::Options o;
        o.chunk_bytes = chunk;
        o.host_id = host_of ? host_of(r) : "one host";
        o.pid = pid_of ? pid_of(r) : 0;
        try {
          ranks[static_cast<size_t>(r)] = ShmCollectives::connect(store, r, size, o, api, &why[static_cast<size_t>(r)]);
        } catch (const std::exception& e) {
          why[static_cast<size_t>(r)] = std::string("threw: ") + e.what();
        }
      });
    for (auto& t : th) t.join();
  }
};

void sum_f32(void* o, const void* a, const void* b, size_t n) {
  for (size_t i = 0; i < n; ++i)
    static_cast<float*>(o)[i] = static_cast<const float*>(a)[i] + static_cast<const float*>(b)[i];
}

using kiln::test::error_of;

// Runs `on1` on a thread of its own (rank 1) and `on0` here (rank 0): what each threw.
std::pair<std::string, std::string> errors_of(const std::function<void()>& on0, const std::function<void()>& on1) {
  std::string e1;
  std::thread t([&] { e1 = error_of(on1); });
  const std::string e0 = error_of(on0);
  t.join();
  return {e0, e1};
}

std::vector<std::string> leftover_segments() {
  std::vector<std::string> out;
  const std::string mine = "kiln-" + std::to_string(getpid()) + "-";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec))
    if (e.path().filename().string().rfind(mine, 0) == 0) out.push_back(e.path().string());
  return out;
}

TEST(ShmCollectives, ThreadsAsRanksGiveTheRankOrderSumsBits) {
  KILN_SKIP_WITHOUT_SHM();
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1e3f);
  for (int size : {2, 3, 4}) {
    // 64-byte chunks: 16 floats, so 1000 elements take 63 chunks with an uneven last one.
    World w(size, system_shm_api(), 64);
    for (int r = 0; r < size; ++r) ASSERT_NE(w.ranks[static_cast<size_t>(r)], nullptr) << w.why[static_cast<size_t>(r)];
    EXPECT_TRUE(leftover_segments().empty());
    for (size_t n : {size_t{1}, size_t{7}, size_t{16}, size_t{17}, size_t{1000}}) {
      std::vector<std::vector<float>> data(static_cast<size_t>(size), std::vector<float>(n));
      for (auto& d : data)
        for (float& x : d) x = normal(rng);
      std::vector<float> want = data[0];  // ((r0 + r1) + r2) + r3, elementwise
      for (int r = 1; r < size; ++r)
        for (size_t i = 0; i < n; ++i) want[i] = want[i] + data[static_cast<size_t>(r)][i];
      std::vector<std::thread> th;
      const auto t0 = Clock::now();
      for (int r = 0; r < size; ++r)
        th.emplace_back([&, r] {
          w.ranks[static_cast<size_t>(r)]->all_reduce(data[static_cast<size_t>(r)].data(), n, sizeof(float), kSum,
                                                      sum_f32, std::chrono::seconds(20));
        });
      for (auto& t : th) t.join();
      // 63 chunks of two waits each: a waiter that were never woken would sleep its 50 ms slices.
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0) << "size " << size << " n " << n;
      for (int r = 0; r < size; ++r)
        EXPECT_EQ(std::memcmp(data[static_cast<size_t>(r)].data(), want.data(), n * sizeof(float)), 0)
            << "size " << size << " n " << n << " rank " << r;
    }
  }
}

// all_gather (in place on odd ranks) and reduce_scatter: exact copies and the rank-order sums' bits.
TEST(ShmCollectives, ThreadsAsRanksGatherAndScatterTheRankOrderBits) {
  KILN_SKIP_WITHOUT_SHM();
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1e3f);
  for (int size : {2, 3, 4}) {
    World w(size, system_shm_api(), 64);  // 64 x size bytes a step: 16 floats a rank's run at most
    for (int r = 0; r < size; ++r) ASSERT_NE(w.ranks[static_cast<size_t>(r)], nullptr) << w.why[static_cast<size_t>(r)];
    for (size_t n : {size_t{1}, size_t{5}, size_t{16}, size_t{17}, size_t{300}}) {
      const size_t total = n * static_cast<size_t>(size);
      std::vector<std::vector<float>> in(static_cast<size_t>(size), std::vector<float>(total));
      for (auto& d : in)
        for (float& x : d) x = normal(rng);
      // all_gather of each rank's first n values; odd ranks gather in place (their part of out).
      std::vector<std::vector<float>> gathered(static_cast<size_t>(size), std::vector<float>(total, -1.0f));
      std::vector<float> want_gather;
      for (int r = 0; r < size; ++r) want_gather.insert(want_gather.end(), in[r].begin(), in[r].begin() + n);
      for (int r = 1; r < size; r += 2)
        std::copy(in[r].begin(), in[r].begin() + n, gathered[r].begin() + static_cast<ptrdiff_t>(r * n));
      std::vector<std::vector<float>> scattered(static_cast<size_t>(size), std::vector<float>(n, -1.0f));
      std::vector<std::thread> th;
      for (int r = 0; r < size; ++r)
        th.emplace_back([&, r] {
          auto& me = *w.ranks[static_cast<size_t>(r)];
          const float* src = r % 2 ? gathered[r].data() + r * n : in[r].data();
          me.all_gather(src, gathered[r].data(), n, sizeof(float), 2, std::chrono::seconds(20));
          me.reduce_scatter(in[r].data(), scattered[r].data(), n, sizeof(float), 3, sum_f32, std::chrono::seconds(20));
        });
      for (auto& t : th) t.join();
      for (int r = 0; r < size; ++r) {
        EXPECT_EQ(gathered[r], want_gather) << "all_gather size " << size << " n " << n << " rank " << r;
        std::vector<float> want(in[0].begin() + static_cast<ptrdiff_t>(r * n), in[0].begin() + static_cast<ptrdiff_t>((r + 1) * n));
        for (int q = 1; q < size; ++q)
          for (size_t i = 0; i < n; ++i) want[i] = want[i] + in[q][r * n + i];
        EXPECT_EQ(std::memcmp(scattered[r].data(), want.data(), n * sizeof(float)), 0)
            << "reduce_scatter size " << size << " n " << n << " rank " << r;
      }
    }
  }
}

// Ranks calling different ops with the same count fail too (the kind names the op).
TEST(ShmCollectives, RanksCallingDifferentOpsFail) {
  KILN_SKIP_WITHOUT_SHM();
  World w(2, system_shm_api(), 1024);
  ASSERT_NE(w.ranks[0], nullptr) << w.why[0];
  std::vector<float> a(8, 1.0f), b(8, 1.0f), g(16);
  const auto [ea, eb] = errors_of(
      [&] { w.ranks[0]->all_reduce(a.data(), 8, sizeof(float), kSum, sum_f32, std::chrono::seconds(20)); },
      [&] { w.ranks[1]->all_gather(b.data(), g.data(), 8, sizeof(float), 2, std::chrono::seconds(20)); });
  EXPECT_TRUE(contains(ea, "shared-memory all_reduce: rank 1 called it with 8 elements of 4 bytes (kind 2)")) << ea;
  EXPECT_TRUE(contains(eb, "shared-memory all_gather: rank 0 called it with 8 elements of 4 bytes (kind 1)")) << eb;
  // reduce_scatter compares its call too
  std::vector<float> in(16, 1.0f), out(8);
  World v(2, system_shm_api(), 1024);  // a fresh segment: the one above is broken
  ASSERT_NE(v.ranks[0], nullptr) << v.why[0];
  const auto [ec, ed] = errors_of(
      [&] { v.ranks[0]->reduce_scatter(in.data(), out.data(), 8, sizeof(float), 3, sum_f32, std::chrono::seconds(20)); },
      [&] { v.ranks[1]->all_gather(b.data(), g.data(), 8, sizeof(float), 2, std::chrono::seconds(20)); });
  EXPECT_TRUE(contains(ec, "shared-memory reduce_scatter: rank 1 called it with 8 elements of 4 bytes (kind 2)")) << ec;
  EXPECT_TRUE(contains(ed, "shared-memory all_gather: rank 0 called it with 8 elements of 4 bytes (kind 3)")) << ed;
}

TEST(ShmCollectives, ARankThatCannotCreateOrMapItLeavesEveryRankWithout) {
  KILN_SKIP_WITHOUT_SHM();
  FakeShm no_create;
  no_create.before_create = [](const std::string& name) { kiln::fail("shm_open(", name, "): No space left on device"); };
  World a(3, no_create, 1024);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(a.ranks[static_cast<size_t>(r)], nullptr);
    EXPECT_TRUE(contains(a.why[static_cast<size_t>(r)], "rank 0 could not create the segment: shm_open(/kiln-"))
        << a.why[static_cast<size_t>(r)];
  }
  FakeShm no_open;
  std::atomic<int> opens{0};
  no_open.before_open = [&](const std::string& name) {
    if (opens++ == 1) kiln::fail("mmap(", name, "): Cannot allocate memory");
  };
  World b(3, no_open, 1024);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(b.ranks[static_cast<size_t>(r)], nullptr);
    EXPECT_TRUE(contains(b.why[static_cast<size_t>(r)], "could not map it: mmap(/kiln-")) << b.why[static_cast<size_t>(r)];
  }
  EXPECT_TRUE(leftover_segments().empty());
}

TEST(ShmCollectives, RanksOfAnotherHostOrTheSwitchOffKeepTheirTcpPath) {
  KILN_SKIP_WITHOUT_SHM();
  World other(3, system_shm_api(), 1024, [](int r) { return r == 2 ? "host b" : "host a"; });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(other.ranks[static_cast<size_t>(r)], nullptr);
    EXPECT_EQ(other.why[static_cast<size_t>(r)], "rank 2 runs on another host (or in other namespaces) than rank 0");
  }
  setenv("KILN_GLOO_SHM", "0", 1);
  World off(2, system_shm_api(), 1024);
  unsetenv("KILN_GLOO_SHM");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(off.ranks[static_cast<size_t>(r)], nullptr);
    EXPECT_EQ(off.why[static_cast<size_t>(r)], "KILN_GLOO_SHM=0");
  }
  World one(1, system_shm_api(), 1024);
  EXPECT_EQ(one.ranks[0], nullptr);
}

TEST(ShmCollectives, AGonePeerEndsTheWaitAtOnceAndALateOneTimesOutNamingIt) {
  KILN_SKIP_WITHOUT_SHM();
  FakeShm gone;
  std::atomic<bool> peer_alive{true};
  gone.alive_fn = [&](int) { return peer_alive.load(); };
  World w(3, gone, 1024);
  ASSERT_NE(w.ranks[0], nullptr) << w.why[0];
  std::vector<float> x(100, 1.0f);
  // Ranks 1 and 2 never come; alive: a timeout of 300 ms names both.
  auto t0 = Clock::now();
  const auto all_reduce_on = [&](int r, std::chrono::milliseconds timeout) {
    return [&, r, timeout] { w.ranks[r]->all_reduce(x.data(), x.size(), sizeof(float), kSum, sum_f32, timeout); };
  };
  const std::string late = error_of(all_reduce_on(0, std::chrono::milliseconds(300)));
  EXPECT_TRUE(contains(late, "shared-memory all_reduce timed out after 300 ms (inputs) waiting for rank(s) 1, 2 "
                             "to arrive")) << late;
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GE(waited, 0.29);
  EXPECT_LT(waited, 2.0);
  const std::string again = error_of(all_reduce_on(0, std::chrono::milliseconds(300)));  // unusable after a failure
  EXPECT_TRUE(contains(again, "unusable after an earlier failure")) << again;
  // Gone peers: the wait ends at the first liveness check, far inside a 20 s timeout. Rank 0
  // already arrived (in the op above), so only rank 2 is named.
  peer_alive = false;
  t0 = Clock::now();
  const std::string dead = error_of<ShmPeerFailed>(all_reduce_on(1, std::chrono::seconds(20)));
  EXPECT_TRUE(contains(dead, "shared-memory all_reduce: rank 2 (pid " + std::to_string(getpid()) + ") is gone (inputs)"))
      << dead;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
}

// Each rank announces a pid of its own; rank 1's is gone, but it arrives (and finishes) before a
// slow rank 2: the others' long wait for rank 2 must not fail on rank 1.
TEST(ShmCollectives, APeerGoneAfterItArrivedDoesNotFailTheOthers) {
  KILN_SKIP_WITHOUT_SHM();
  FakeShm api;
  api.alive_fn = [](int pid) { return pid != 1001; };
  World w(3, api, 1024, nullptr, Millis(20000), [](int r) { return 1000 + r; });
  for (int r = 0; r < 3; ++r) ASSERT_NE(w.ranks[static_cast<size_t>(r)], nullptr) << w.why[static_cast<size_t>(r)];
  std::vector<std::vector<float>> data(3, std::vector<float>(40, 1.0f));
  std::vector<std::string> errors(3);
  std::vector<std::thread> th;
  for (int r = 0; r < 3; ++r)
    th.emplace_back([&, r] {
      if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(350));  // past three liveness checks
      errors[static_cast<size_t>(r)] = error_of([&] {
        w.ranks[static_cast<size_t>(r)]->all_reduce(data[static_cast<size_t>(r)].data(), 40, sizeof(float), kSum,
                                                    sum_f32, std::chrono::seconds(20));
      });
    });
  for (auto& t : th) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "(no error)") << "rank " << r;
    EXPECT_EQ(data[static_cast<size_t>(r)], std::vector<float>(40, 3.0f)) << "rank " << r;
  }
}

TEST(ShmCollectives, RanksCallingWithDifferentSizesFailInsteadOfMixingData) {
  KILN_SKIP_WITHOUT_SHM();
  World w(2, system_shm_api(), 1024);
  ASSERT_NE(w.ranks[0], nullptr) << w.why[0];
  std::vector<float> a(10, 1.0f), b(12, 1.0f);
  const auto [ea, eb] = errors_of(
      [&] { w.ranks[0]->all_reduce(a.data(), a.size(), sizeof(float), kSum, sum_f32, std::chrono::seconds(20)); },
      [&] { w.ranks[1]->all_reduce(b.data(), b.size(), sizeof(float), kSum, sum_f32, std::chrono::seconds(20)); });
  EXPECT_TRUE(contains(ea, "rank 1 called it with 12 elements of 4 bytes (kind 1), rank 0 with 10 of 4 (kind 1)")) << ea;
  EXPECT_TRUE(contains(eb, "rank 0 called it with 10 elements of 4 bytes (kind 1), rank 1 with 12 of 4 (kind 1)")) << eb;
}

// Rank 0 made the segment; rank 1 answers only after rank 0's store wait gave up: rank 0 throws,
// and leaves nothing in /dev/shm; rank 1 finds no segment and goes without. A rank 0 that throws
// while setting it up tells the others, who go without instead of waiting for it.
TEST(ShmCollectives, ASetupThatFailsLeavesNothingBehindAndNobodyWaiting) {
  KILN_SKIP_WITHOUT_SHM();
  FakeShm slow;
  slow.before_open = [](const std::string&) { std::this_thread::sleep_for(std::chrono::milliseconds(900)); };
  World w(2, slow, 1024, nullptr, Millis(400));
  EXPECT_TRUE(contains(w.why[0], "threw: ")) << w.why[0];
  EXPECT_EQ(w.ranks[0], nullptr);
  EXPECT_EQ(w.ranks[1], nullptr);
  EXPECT_TRUE(leftover_segments().empty());
  FakeShm throws;
  throws.before_create = [](const std::string&) { throw std::runtime_error("random_device: no entropy"); };
  const auto t0 = Clock::now();
  World v(3, throws, 1024);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 5.0);
  EXPECT_EQ(v.why[0], "threw: random_device: no entropy");
  for (int r = 1; r < 3; ++r)
    EXPECT_EQ(v.why[static_cast<size_t>(r)], "rank 0 failed setting it up: random_device: no entropy");
}

// Rank 1, 150 ms into rank 0's wait for it, fails elsewhere (abort_peers) or destroys its
// communicator (left): rank 0's wait ends at once, with rank 1's word.
TEST(ShmCollectives, APeerThatFailsOrLeavesEndsTheWaitForIt) {
  KILN_SKIP_WITHOUT_SHM();
  const std::pair<std::function<void(ShmCollectives&)>, std::string> cases[] = {
      {[](ShmCollectives& c) { c.abort_peers("rank 1: all_reduce #4 of 'world' failed"); },
       "shared-memory all_reduce: rank 1 failed: rank 1: all_reduce #4 of 'world' failed"},
      {[](ShmCollectives& c) { c.left(); }, "shared-memory all_reduce: rank 1 left: rank 1 destroyed its communicator"}};
  for (const auto& [act, want] : cases) {
    World w(2, system_shm_api(), 1024);
    ASSERT_NE(w.ranks[0], nullptr) << w.why[0];
    std::thread peer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      act(*w.ranks[1]);
    });
    std::vector<float> x(10, 1.0f);
    const auto t0 = Clock::now();
    const std::string e = error_of<ShmPeerFailed>(
        [&] { w.ranks[0]->all_reduce(x.data(), x.size(), sizeof(float), kSum, sum_f32, std::chrono::seconds(20)); });
    EXPECT_TRUE(contains(e, want)) << e;
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
    peer.join();
  }
}

}  // namespace
}  // namespace kiln::dist

