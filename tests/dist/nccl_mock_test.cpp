// The NCCL backend's logic over fake NcclApi / CudaApi (no GPU): nonblocking init polled to
// completion and with a deadline, operations completed by their end events, the clock started
// by the start event, an async error, a call that stays ncclInProgress forever, a kernel that
// never ends, abort (never followed by destroy; a clean communicator is finalized and destroyed),
// shrink with ncclCommShrink and without it (abort and a new communicator under the next
// generation), the abort policy's process exit, wait_on_device() (the caller's stream ordered, the
// host free; the host waiting under shrink), and bad input.
#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "kiln/dist/nccl_backend.h"
#include "kiln/ops/ops.h"

using namespace kiln;
using namespace kiln::dist;
using namespace std::chrono_literals;

namespace {

class FakeNccl : public NcclApi {
 public:
  std::mutex mu;
  int init_in_progress_polls = 0;   // -1: forever
  int op_in_progress_polls = 0;     // after each op, -1: forever
  NcclResult async_error = NcclResult::success;
  bool shrink_available = true;
  std::map<std::string, int> calls;
  std::vector<int> shrink_exclude;
  int pending = 0;
  std::atomic<intptr_t> next_comm{1};

  void count(const char* c) {
    std::lock_guard<std::mutex> lock(mu);
    ++calls[c];
  }
  int n(const char* c) {
    std::lock_guard<std::mutex> lock(mu);
    return calls[c];
  }
  int version() override { return shrink_available ? 22803 : 22605; }
  const char* error_string(NcclResult r) override {
    return r == NcclResult::remote_error ? "remote process exited or there was a network error" : "nccl error";
  }
  std::string last_error(NcclCommHandle) override { return "fake last error"; }
  NcclResult get_unique_id(NcclUniqueIdBytes* id) override {
    count("get_unique_id");
    std::memset(id->bytes, 7, sizeof id->bytes);
    return NcclResult::success;
  }
  NcclResult comm_init_rank_config(NcclCommHandle* c, int, const NcclUniqueIdBytes&, int, const NcclCommConfig& cfg) override {
    count("init");
    EXPECT_FALSE(cfg.blocking);
    *c = reinterpret_cast<NcclCommHandle>(next_comm++);
    std::lock_guard<std::mutex> lock(mu);
    pending = init_in_progress_polls;
    return NcclResult::in_progress;
  }
  NcclResult comm_get_async_error(NcclCommHandle, NcclResult* st) override {
    std::lock_guard<std::mutex> lock(mu);
    ++calls["get_async_error"];
    if (pending != 0) {
      if (pending > 0) --pending;
      *st = NcclResult::in_progress;
    } else {
      *st = async_error;
    }
    return NcclResult::success;
  }
  NcclResult comm_finalize(NcclCommHandle) override { count("finalize"); return NcclResult::success; }
  NcclResult comm_destroy(NcclCommHandle) override { count("destroy"); return NcclResult::success; }
  NcclResult comm_abort(NcclCommHandle) override { count("abort"); return NcclResult::success; }
  NcclResult comm_split(NcclCommHandle, int, int, NcclCommHandle*, const NcclCommConfig&) override {
    return NcclResult::invalid_usage;
  }
  bool has_shrink() override { return shrink_available; }
  NcclResult comm_shrink(NcclCommHandle, const std::vector<int>& ex, NcclCommHandle* out, const NcclCommConfig&,
                         bool abort_ongoing) override {
    count("shrink");
    EXPECT_TRUE(abort_ongoing);
    std::lock_guard<std::mutex> lock(mu);
    shrink_exclude = ex;
    async_error = NcclResult::success;  // the new communicator is healthy
    *out = reinterpret_cast<NcclCommHandle>(next_comm++);
    return NcclResult::success;
  }
  NcclResult op() {
    std::lock_guard<std::mutex> lock(mu);
    ++calls["op"];
    pending = op_in_progress_polls;
    return op_in_progress_polls ? NcclResult::in_progress : NcclResult::success;
  }
  NcclResult all_reduce(const void*, void*, size_t, NcclDtype, NcclRedOp, NcclCommHandle, CudaStreamHandle) override { return op(); }
  NcclResult all_gather(const void*, void*, size_t, NcclDtype, NcclCommHandle, CudaStreamHandle) override { return op(); }
  NcclResult reduce_scatter(const void*, void*, size_t, NcclDtype, NcclRedOp, NcclCommHandle, CudaStreamHandle) override { return op(); }
  NcclResult broadcast(const void*, void*, size_t, NcclDtype, int, NcclCommHandle, CudaStreamHandle) override { return op(); }
  NcclResult send(const void*, size_t, NcclDtype, int, NcclCommHandle, CudaStreamHandle) override { return op(); }
  NcclResult recv(void*, size_t, NcclDtype, int, NcclCommHandle, CudaStreamHandle) override { return op(); }
  NcclResult group_start() override { return NcclResult::success; }
  NcclResult group_end() override { return NcclResult::success; }
};

// Events are done when recorded unless the test holds start or end events back.
class FakeCuda : public CudaApi {
 public:
  std::mutex mu;
  bool hold_start = false, hold_end = false;
  std::map<intptr_t, bool> done;
  std::map<intptr_t, bool> is_start;  // the backend creates start, then end, per op (after "ready")
  intptr_t next = 1;
  int created = 0, destroyed = 0;
  CudaStreamHandle comm_stream(int) override { return reinterpret_cast<CudaStreamHandle>(0x10); }
  CudaStreamHandle caller_stream(int) override { return reinterpret_cast<CudaStreamHandle>(0x20); }
  CudaEventHandle event_create(int) override {
    std::lock_guard<std::mutex> lock(mu);
    ++created;
    done[next] = false;
    return reinterpret_cast<CudaEventHandle>(next++);
  }
  void event_destroy(CudaEventHandle e) override {
    std::lock_guard<std::mutex> lock(mu);
    ++destroyed;
    done.erase(reinterpret_cast<intptr_t>(e));
  }
  void event_record(CudaEventHandle e, CudaStreamHandle) override {
    std::lock_guard<std::mutex> lock(mu);
    // Creation order per op: ready (destroyed at once), start, end.
    const intptr_t id = reinterpret_cast<intptr_t>(e);
    const bool start = done.count(id + 1) > 0;  // the end event was created after it
    done[id] = start ? !hold_start : !hold_end;
  }
  bool event_query(CudaEventHandle e) override {
    std::lock_guard<std::mutex> lock(mu);
    return done[reinterpret_cast<intptr_t>(e)];
  }
  std::vector<std::pair<intptr_t, intptr_t>> stream_waits;  // (stream, event)
  void stream_wait_event(CudaStreamHandle st, CudaEventHandle e) override {
    std::lock_guard<std::mutex> lock(mu);
    stream_waits.emplace_back(reinterpret_cast<intptr_t>(st), reinterpret_cast<intptr_t>(e));
  }
  // The events the caller's stream (0x20) was made to wait for.
  std::vector<intptr_t> caller_waits() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<intptr_t> out;
    for (auto [st, e] : stream_waits)
      if (st == 0x20) out.push_back(e);
    return out;
  }
  void release_all() {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [k, v] : done) v = true;
  }
  // Ops queued from now on stay unfinished until release_all().
  void hold_ends() {
    std::lock_guard<std::mutex> lock(mu);
    hold_end = true;
  }
  // A device that finishes everything after `delay`, on a thread of its own (join it).
  std::thread release_after(std::chrono::milliseconds delay) {
    return std::thread([this, delay] {
      std::this_thread::sleep_for(delay);
      release_all();
    });
  }
};

struct FakeWorld {
  std::shared_ptr<FakeNccl> nccl = std::make_shared<FakeNccl>();
  std::shared_ptr<FakeCuda> cuda = std::make_shared<FakeCuda>();
  std::unique_ptr<StoreServer> server;
  std::shared_ptr<Store> store;
  CommOptions opt;
  NcclBackendOptions bopt;
  FakeWorld() {
    StoreServerOptions so;
    so.token = "t";
    so.quiet = true;
    server = std::make_unique<StoreServer>(so);
    store = std::make_shared<TcpStore>("127.0.0.1", server->port(), "t");
    opt.timeout = 300ms;
    opt.abort_process = false;
    opt.shrink_window = 200ms;
    opt.watchdog_interval = 50ms;
    bopt.place = TensorPlace::cpu;
    bopt.start_watchdog = false;
  }
  std::shared_ptr<NcclCommunicator> make(int rank = 0, int size = 1, const std::string& name = "world") {
    return new_nccl_communicator(nccl, cuda, store, rank, size, name, opt, bopt);
  }
};

Tensor ones(int64_t n) { return full({n}, 1.0); }

}  // namespace

TEST(NcclMock, InitPolledUntilReadyOpsCompleteAtEndEventCleanDestroy) {
  FakeWorld s;
  s.nccl->init_in_progress_polls = 3;
  {
    auto c = s.make();
    EXPECT_EQ(s.nccl->n("init"), 1);
    EXPECT_GE(s.nccl->n("get_async_error"), 4);
    Tensor t = ones(8);
    auto w = c->all_reduce(t, ReduceOp::sum);
    EXPECT_EQ(w->state(), WorkState::not_started);
    c->watchdog_tick();
    EXPECT_TRUE(w->is_completed());
    w->wait();
    Tensor out = Tensor::empty({8});
    c->all_gather_single(out, t);
    c->reduce_scatter_single(t, out, ReduceOp::avg);
    c->all_to_all_single(out, out.clone());
    c->broadcast(t, 0);
    c->barrier();
    c->watchdog_tick();
    EXPECT_EQ(c->in_flight(), 0u);
  }
  EXPECT_EQ(s.nccl->n("finalize"), 1);
  EXPECT_EQ(s.nccl->n("destroy"), 1);
  EXPECT_EQ(s.nccl->n("abort"), 0);
  EXPECT_EQ(s.cuda->created, s.cuda->destroyed);
}

TEST(NcclMock, EndlessInProgressInitTimesOutAbortsNeverDestroys) {
  FakeWorld s;
  s.nccl->init_in_progress_polls = -1;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    s.make();
    FAIL() << "init did not time out";
  } catch (const CommTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("ncclCommInitRankConfig stayed ncclInProgress for 300 ms"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_EQ(s.nccl->n("abort"), 1);
  EXPECT_EQ(s.nccl->n("destroy"), 0);
}

TEST(NcclMock, EndlessInProgressOpTimesOutAndCommunicatorRaisesAfter) {
  FakeWorld s;
  auto c = s.make();
  s.nccl->op_in_progress_polls = -1;
  auto w = c->all_reduce(ones(4), ReduceOp::sum);
  EXPECT_EQ(w->state(), WorkState::timed_out);
  try {
    w->wait();
    FAIL();
  } catch (const CommTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce #1 of 'world' (4 elements of f32) stayed ncclInProgress"),
              std::string::npos) << e.what();
  }
  EXPECT_EQ(s.nccl->n("abort"), 1);
  try {
    c->barrier();
    FAIL() << "a broken communicator accepted an op";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is broken"), std::string::npos) << e.what();
  }
  c.reset();
  EXPECT_EQ(s.nccl->n("destroy"), 0);  // never destroy after abort
}

TEST(NcclMock, AsyncErrorFailsInFlightWorkWithTheNcclMessage) {
  FakeWorld s;
  auto c = s.make();
  s.cuda->hold_ends();
  auto w1 = c->all_reduce(ones(4), ReduceOp::sum);
  auto w2 = c->broadcast(ones(2), 0);
  c->watchdog_tick();
  EXPECT_EQ(w1->state(), WorkState::in_progress);
  s.nccl->async_error = NcclResult::remote_error;
  c->watchdog_tick();
  EXPECT_EQ(w1->state(), WorkState::error);
  EXPECT_EQ(w2->state(), WorkState::error);
  try {
    w1->wait();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("async error remote process exited"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("all_reduce #1 of 'world'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.nccl->n("abort"), 1);
  c.reset();
  EXPECT_EQ(s.nccl->n("destroy"), 0);
  EXPECT_EQ(s.cuda->created, s.cuda->destroyed);
}

TEST(NcclMock, ClockStartsAtTheStartEventAndTimesOutAKernelThatNeverEnds) {
  FakeWorld s;
  auto c = s.make();
  s.cuda->hold_start = s.cuda->hold_end = true;
  auto w = c->all_reduce(ones(4), ReduceOp::max);
  std::this_thread::sleep_for(400ms);  // past the timeout, but the op has not started on the device
  c->watchdog_tick();
  EXPECT_EQ(w->state(), WorkState::not_started);
  s.cuda->hold_start = false;
  s.cuda->release_all();  // start (and end) done...
  {
    // ...except the end: hold it again by re-marking (the kernel never ends).
  }
  auto w2 = c->all_reduce(ones(4), ReduceOp::max);  // its start done at record, end held
  c->watchdog_tick();  // w completes, w2 starts now
  EXPECT_TRUE(w->is_completed());
  EXPECT_EQ(w2->state(), WorkState::in_progress);
  std::this_thread::sleep_for(400ms);
  c->watchdog_tick();
  EXPECT_EQ(w2->state(), WorkState::timed_out);
  EXPECT_EQ(s.nccl->n("abort"), 1);
}

TEST(NcclMock, ShrinkWithNcclCommShrink) {
  FakeWorld s;
  s.opt.policy = FailurePolicy::shrink;
  auto c = s.make(0, 2);  // rank 1 never shows up to the agreement: it is dead
  s.cuda->hold_ends();
  auto w = c->all_reduce(ones(4), ReduceOp::sum);
  c->watchdog_tick();
  s.nccl->async_error = NcclResult::remote_error;
  c->watchdog_tick();
  try {
    w->wait();
    FAIL();
  } catch (const PeerLost& e) {
    ASSERT_NE(e.communicator(), nullptr);
    EXPECT_EQ(e.communicator()->size(), 1);
    EXPECT_EQ(e.communicator()->rank(), 0);
    EXPECT_EQ(e.communicator()->generation(), 1);
    EXPECT_EQ(e.lost_ranks(), std::vector<int>{1});
    s.cuda->hold_end = false;
    auto w2 = e.communicator()->all_reduce(ones(2), ReduceOp::sum);
    static_cast<NcclCommunicator&>(*e.communicator()).watchdog_tick();
    EXPECT_TRUE(w2->is_completed());
  }
  EXPECT_EQ(s.nccl->n("shrink"), 1);
  EXPECT_EQ(s.nccl->shrink_exclude, std::vector<int>{1});
  EXPECT_THROW(c->barrier(), PeerLost);
}

TEST(NcclMock, ShrinkUnavailableAbortsAndReinitsUnderTheNextGeneration) {
  FakeWorld s;
  s.opt.policy = FailurePolicy::shrink;
  s.nccl->shrink_available = false;
  auto c = s.make(0, 2);
  s.cuda->hold_ends();
  auto w = c->all_reduce(ones(4), ReduceOp::sum);
  s.nccl->async_error = NcclResult::remote_error;
  // The re-init's polls must see a healthy communicator: clear the error once abort is called.
  std::thread fixer([&] {
    for (int i = 0; i < 200 && s.nccl->n("abort") == 0; ++i) std::this_thread::sleep_for(5ms);
    s.nccl->async_error = NcclResult::success;
  });
  c->watchdog_tick();
  fixer.join();
  EXPECT_THROW(w->wait(), PeerLost);
  EXPECT_EQ(s.nccl->n("shrink"), 0);
  EXPECT_EQ(s.nccl->n("abort"), 1);
  EXPECT_EQ(s.nccl->n("init"), 2);
  EXPECT_EQ(s.nccl->n("get_unique_id"), 2);
  EXPECT_TRUE(s.store->check({"kiln/nccl/world/g1/unique_id"}));
  c.reset();
  EXPECT_EQ(s.nccl->n("destroy"), 0);
}

TEST(NcclMock, AbortPolicyExitsTheProcessNamingTheOp) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeWorld s;
        s.opt.abort_process = true;
        auto c = s.make();
        s.nccl->op_in_progress_polls = -1;
        c->all_reduce(ones(4), ReduceOp::sum);
      },
      ::testing::ExitedWithCode(kAbortExitCode), "all_reduce #1 of 'world'.*policy abort: ncclCommAbort done");
}

TEST(NcclMock, BadInputNamesTheProblemAndLeavesTheCommunicatorUsable) {
  FakeWorld s;
  s.bopt.place = TensorPlace::cuda;
  auto c = s.make();
  try {
    c->all_reduce(ones(4), ReduceOp::sum);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the nccl backend takes CUDA tensors"), std::string::npos) << e.what();
  }
  FakeWorld s2;
  auto c2 = s2.make();
  EXPECT_THROW(c2->all_reduce(Tensor::empty({2}, DType::boolean), ReduceOp::sum), Error);
  EXPECT_THROW(c2->reduce_scatter_single(Tensor::empty({2}), Tensor::empty({3}), ReduceOp::sum), Error);
  auto w = c2->all_reduce(ones(2), ReduceOp::sum);
  c2->watchdog_tick();
  EXPECT_TRUE(w->is_completed());
}

// wait() ends a finished operation itself (its events queried from the waiting thread), in
// order, instead of sleeping until the watchdog's next tick; one the device has not finished
// keeps it waiting, and it returns once the device finishes (no tick in between).
TEST(NcclMock, WaitReturnsWhenTheDeviceFinishesNotAtTheWatchdogsTick) {
  FakeWorld s;
  s.opt.timeout = std::chrono::milliseconds(5000);
  auto c = s.make();  // no watchdog thread: only wait() can end the Work
  auto first = c->all_reduce(ones(4), ReduceOp::sum), second = c->all_reduce(ones(4), ReduceOp::sum);
  const auto t0 = std::chrono::steady_clock::now();
  second->wait();
  EXPECT_TRUE(first->is_completed());  // the one ahead of it was ended first
  EXPECT_TRUE(second->is_completed());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(200));
  EXPECT_EQ(c->in_flight(), 0u);

  s.cuda->hold_ends();
  auto held = c->all_reduce(ones(4), ReduceOp::sum);
  std::thread device = s.cuda->release_after(std::chrono::milliseconds(300));
  const auto t1 = std::chrono::steady_clock::now();
  held->wait();
  const auto waited = std::chrono::steady_clock::now() - t1;
  device.join();
  EXPECT_TRUE(held->is_completed());
  EXPECT_GE(waited, std::chrono::milliseconds(250));
  EXPECT_LT(waited, std::chrono::milliseconds(1500));
}

// wait_on_device() orders the caller's stream after the operation's end event and returns with
// the device still at work (the host runs ahead, as torch's NCCL Work.wait()); an operation that
// has ended needs no order; under the shrink policy the host waits, so a lost peer surfaces there.
TEST(NcclMock, WaitOnDeviceOrdersTheCallersStreamAndLeavesTheHostFree) {
  FakeWorld s;
  s.opt.timeout = std::chrono::milliseconds(5000);
  auto c = s.make();
  s.cuda->hold_ends();
  auto held = c->all_gather_single(Tensor::empty({4}), ones(4));
  const auto t0 = std::chrono::steady_clock::now();
  held->wait_on_device();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(200));
  EXPECT_FALSE(held->is_completed());  // the device has not finished it
  ASSERT_EQ(s.cuda->caller_waits().size(), 1u);
  const intptr_t end_event = s.cuda->caller_waits()[0];
  {
    std::lock_guard<std::mutex> lock(s.cuda->mu);
    EXPECT_EQ(s.cuda->done.count(end_event), 1u);  // a live event: the end of that operation
    EXPECT_FALSE(s.cuda->done[end_event]);
  }
  s.cuda->release_all();
  c->watchdog_tick();
  EXPECT_TRUE(held->is_completed());
  held->wait_on_device();  // ended: nothing more to order
  EXPECT_EQ(s.cuda->caller_waits().size(), 1u);

  // Shrink: the host waits for the end.
  FakeWorld t;
  t.opt.timeout = std::chrono::milliseconds(5000);
  t.opt.policy = FailurePolicy::shrink;
  auto d = t.make();
  t.cuda->hold_ends();
  auto w = d->all_reduce(ones(4), ReduceOp::sum);
  std::thread device = t.cuda->release_after(std::chrono::milliseconds(300));
  const auto t1 = std::chrono::steady_clock::now();
  w->wait_on_device();
  const auto waited = std::chrono::steady_clock::now() - t1;
  device.join();
  EXPECT_TRUE(w->is_completed());
  EXPECT_GE(waited, std::chrono::milliseconds(250));
  EXPECT_TRUE(t.cuda->caller_waits().empty());
}
