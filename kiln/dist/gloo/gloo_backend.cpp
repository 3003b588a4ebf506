// The Gloo backend (CPU tensors): a gloo::rendezvous::Context per communicator, connected full
// mesh through kiln's store (gloo_store.h); one worker thread runs the operations in order (Gloo
// calls block), each with its timeout starting when it starts, unless the thread waiting for the
// next one runs it itself (run_inline; a world of one runs each op as it is issued, when nothing
// is ahead of it); a watchdog publishes progress. all_reduce, all_gather and reduce_scatter among
// ranks that all run on this host go through one shared-memory segment (shm_collectives.h).
// Otherwise, all_reduce of a small tensor is one direct exchange (direct_allreduce), of a larger
// one Gloo's ring; reduce_scatter_single is an all-to-all of the chunks then a local reduction in
// rank order (bandwidth-optimal: each rank receives only its chunk from every peer); avg divides a
// sum.
// On a failure the context is destroyed at once (its peers see "connection closed" and fail
// too; those in the segment are told through it), the flight recorder is dumped, a log line
// names the op and the ranks that never joined, and the policy runs: abort exits the process;
// shrink has the survivors agree on who is alive (a generation number, a deadline, one
// compare_set), rebuild a smaller context, and fail the Work with PeerLost carrying it.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <sstream>
#include <thread>

#include "kiln/core/env.h"
#include "kiln/core/half.h"
#include "kiln/dist/backends.h"
#include "kiln/dist/dist_log.h"
#include "kiln/dist/flight_recorder.h"
#include "kiln/dist/gloo/gloo_store.h"
#include "kiln/dist/progress.h"
#include "kiln/dist/shm_collectives.h"
#include "kiln/dist/survivors.h"
#include "kiln/dist/watchdog.h"

namespace kiln::dist {
namespace {

using Clock = std::chrono::steady_clock;

template <class T, class F>
void reduce_loop(void* out, const void* a, const void* b, size_t n, F f) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = f(x[i], y[i]);
}

template <class T, class C>  // C: the type the math runs in
ReduceFn make_reduce_typed(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: case ReduceOp::avg:
      return [](void* o, const void* a, const void* b, size_t n) {
        reduce_loop<T>(o, a, b, n, [](T x, T y) { return T(static_cast<C>(x) + static_cast<C>(y)); });
      };
    case ReduceOp::product:
      return [](void* o, const void* a, const void* b, size_t n) {
        reduce_loop<T>(o, a, b, n, [](T x, T y) { return T(static_cast<C>(x) * static_cast<C>(y)); });
      };
    case ReduceOp::min:
      return [](void* o, const void* a, const void* b, size_t n) {
        reduce_loop<T>(o, a, b, n, [](T x, T y) { return static_cast<C>(y) < static_cast<C>(x) ? y : x; });
      };
    case ReduceOp::max:
      return [](void* o, const void* a, const void* b, size_t n) {
        reduce_loop<T>(o, a, b, n, [](T x, T y) { return static_cast<C>(y) > static_cast<C>(x) ? y : x; });
      };
  }
  return {};
}

ReduceFn make_reduce(DType dt, ReduceOp op) {
  switch (dt) {
    case DType::f32: return make_reduce_typed<float, float>(op);
    case DType::f64: return make_reduce_typed<double, double>(op);
    case DType::bf16: return make_reduce_typed<BFloat16, float>(op);
    case DType::f16: return make_reduce_typed<Half, float>(op);
    case DType::i32: return make_reduce_typed<int32_t, int32_t>(op);
    case DType::i64: return make_reduce_typed<int64_t, int64_t>(op);
    case DType::u8: return make_reduce_typed<uint8_t, uint8_t>(op);
    default: fail("gloo backend: no reduction for dtype ", dtype_name(dt));
  }
}

template <class T>
void divide_typed(void* p, size_t n, int by) {
  auto* x = static_cast<T*>(p);
  for (size_t i = 0; i < n; ++i) x[i] = T(static_cast<float>(x[i]) / static_cast<float>(by));
}

void divide(DType dt, void* p, size_t n, int by) {
  switch (dt) {
    case DType::f32: divide_typed<float>(p, n, by); break;
    case DType::bf16: divide_typed<BFloat16>(p, n, by); break;
    case DType::f16: divide_typed<Half>(p, n, by); break;
    case DType::f64: {
      auto* x = static_cast<double*>(p);
      for (size_t i = 0; i < n; ++i) x[i] /= by;
      break;
    }
    default: fail("avg: dtype ", dtype_name(dt), " is not floating");
  }
}

// Gloo's typed setters only use sizeof(T): pick the unsigned type of the element's width.
template <class F>
void with_width(size_t itemsize, F&& f) {
  switch (itemsize) {
    case 1: f(uint8_t{}); break;
    case 2: f(uint16_t{}); break;
    case 4: f(uint32_t{}); break;
    default: f(uint64_t{}); break;
  }
}

std::string gloo_hostname() {
  if (const char* h = std::getenv("KILN_GLOO_HOSTNAME"); h && *h) return h;
  const char* m = std::getenv("MASTER_ADDR");
  const std::string master = m ? m : "";
  if (master.empty() || master == "127.0.0.1" || master == "localhost" || master == "::1") return "127.0.0.1";
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

// Receive space of the worker's operations, kept from one op to the next: a fresh 64 MiB vector
// per reduce_scatter cost a zeroing pass and 16 k page faults each time. Up to kKeep bytes stay
// allocated between ops; a larger buffer is freed after its op. Only the worker thread uses it.
class Scratch {
 public:
  uint8_t* get(size_t bytes) {
    if (bytes > cap_) {
      buf_.reset();  // the old one first: never both alive
      buf_.reset(new uint8_t[bytes]);
      cap_ = bytes;
    }
    return buf_.get();
  }
  void trim() {
    if (cap_ > kKeep) {
      buf_.reset();
      cap_ = 0;
    }
  }

 private:
  static constexpr size_t kKeep = size_t{256} << 20;
  std::unique_ptr<uint8_t[]> buf_;
  size_t cap_ = 0;
};

struct Context {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  int rank, size;
  Scratch* scratch;
  ShmCollectives* shm;  // null unless every rank runs on this host
};

// A size in bytes from the environment (a tuning knob), else `dflt`.
size_t env_bytes(const char* name, size_t dflt) {
  return static_cast<size_t>(env_integer(name, 0, int64_t{1} << 40, static_cast<int64_t>(dflt)));
}

// all_reduce tuning (bench comms' figures in BENCHMARKS.md): where every rank runs on this host, the
// shared-memory segment at every size (chunks of KILN_GLOO_SHM_CHUNK_BYTES; KILN_GLOO_SHM=0 keeps
// the paths below; 4-15 x the direct exchange at 4-64 KiB, 4 x the ring at 64 MiB on the 2-core
// VM). Otherwise, up to KILN_GLOO_DIRECT_BYTES of data
// sent per rank ((size - 1) x the tensor), every rank sends its whole tensor to every peer at once
// and reduces the size inputs in rank order itself (one round of messages instead of the ring's
// 2(size - 1) x segments, which on a loaded machine each wait on a thread wake-up); above it, Gloo's
// ring with segments of KILN_GLOO_SEGMENT_BYTES. Every rank computes the same bits either way.
size_t direct_allreduce_bytes() {
  static const size_t v = env_bytes("KILN_GLOO_DIRECT_BYTES", size_t{256} << 10);
  return v;
}
size_t ring_segment_bytes() {
  static const size_t v = env_bytes("KILN_GLOO_SEGMENT_BYTES", 0);  // 0: Gloo's own (1 MiB)
  return v;
}
size_t shm_chunk_bytes() { return env_bytes("KILN_GLOO_SHM_CHUNK_BYTES", size_t{1} << 20); }
// The tag every rank of a shared-memory op compares (shm_collectives.h): the op (1 all_reduce,
// 2 all_gather, 3 reduce_scatter), the reduction and the dtype.
uint32_t shm_kind(uint32_t which, ReduceOp op, DType dt) {
  return which << 16 | static_cast<uint32_t>(op) << 8 | static_cast<uint32_t>(dt);
}

constexpr uint8_t kDirectSlotPrefix = 0x4b;  // apart from Gloo's own collectives' prefixes (0x01-0x08)

void direct_allreduce(Context& c, void* data, size_t n, size_t item, const ReduceFn& fn, Millis tmo, uint32_t tag) {
  const size_t bytes = n * item;
  uint8_t* recv = c.scratch->get(bytes * static_cast<size_t>(c.size));
  auto sb = c.ctx->createUnboundBuffer(data, bytes);
  auto rb = c.ctx->createUnboundBuffer(recv, bytes * static_cast<size_t>(c.size));
  const uint64_t slot = gloo::Slot::build(kDirectSlotPrefix, tag);
  for (int k = 1; k < c.size; ++k) {
    const int peer = (c.rank + k) % c.size;
    rb->recv(peer, slot, bytes * static_cast<size_t>(peer), bytes);
    sb->send((c.rank + c.size - k) % c.size, slot);
  }
  for (int k = 1; k < c.size; ++k) {
    rb->waitRecv(tmo);
    sb->waitSend(tmo);
  }
  // input(r): rank r's tensor. The result is ((in0 op in1) op in2) ..., the same order on every
  // rank; this rank's own input is read in place while it is still unwritten (r <= 1), else from
  // a copy.
  auto* out = static_cast<uint8_t*>(data);
  if (c.rank >= 2) std::memcpy(recv + bytes * static_cast<size_t>(c.rank), data, bytes);
  auto input = [&](int r) -> const void* { return r == c.rank && r <= 1 ? out : recv + bytes * static_cast<size_t>(r); };
  fn(out, input(0), input(1), n);
  for (int r = 2; r < c.size; ++r) fn(out, out, input(r), n);
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<Store> store, int rank, int size, std::string name, CommOptions options,
                   int generation, std::string prefix, std::vector<int> members)
      : store_(std::move(store)), rank_(rank), size_(size), name_(std::move(name)), options_(options),
        generation_(generation), prefix_(std::move(prefix)), members_(std::move(members)) {
    KILN_CHECK(store_ != nullptr, "gloo communicator '", name_, "': the store is null");
    KILN_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "gloo communicator '", name_, "': rank ", rank_,
               " out of range [0, ", size_, ")");
    KILN_CHECK(options_.timeout.count() > 0, "gloo communicator '", name_, "': timeout ",
               options_.timeout.count(), " ms must be positive");
    scoped_ = std::make_shared<PrefixStore>(prefix_, store_);
    scoped_->set_timeout(options_.timeout);
    progress_ = std::make_unique<ProgressBoard>(scoped_, rank_, size_);
    const auto t0 = Clock::now();
    if (size_ > 1) {
      gloo::transport::tcp::attr attr;
      attr.hostname = gloo_hostname();
      device_ = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
      ctx->setTimeout(options_.timeout);
      GlooStoreAdapter adapter(std::make_shared<PrefixStore>("rdzv", scoped_));
      try {
        ctx->connectFullMesh(adapter, device_);
      } catch (const std::exception& e) {
        fail("gloo communicator '", name_, "' (rank ", rank_, " of ", size_, "): connecting to its peers failed: ",
             e.what());
      }
      ctx_ = std::move(ctx);
      ShmCollectives::Options so;
      so.chunk_bytes = shm_chunk_bytes();
      shm_ = ShmCollectives::connect(*scoped_, rank_, size_, so, system_shm_api(), &shm_off_);
    }
    json::Value ev = json::Value::object();
    ev["event"] = "init";
    ev["backend"] = "gloo";
    ev["comm"] = name_;
    ev["comm_rank"] = rank_;
    ev["comm_size"] = size_;
    ev["generation"] = generation_;
    ev["shared_memory"] = shm_ ? std::string("on") : "off: " + (shm_off_.empty() ? "a world of one" : shm_off_);
    ev["seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
    rank_event(ev);
    FlightRecorder::instance().joined({name_, generation_, rank_, size_, members_});
    FlightRecorder::install_sigusr1();
    worker_ = std::thread([this] { work_loop(); });
    watchdog_ = std::make_unique<Watchdog>(options_.watchdog_interval, [this] { tick(); });
  }

  ~GlooCommunicator() override {
    watchdog_.reset();
    if (shm_) shm_->left();  // a peer still waiting for this rank in the segment fails now
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    // send / recv threads hold `this`: each ends within its timeout.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return p2p_running_ == 0; });
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const char* backend() const override { return "gloo"; }
  Device device() const override { return kCPU; }
  int generation() const override { return generation_; }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op, CallOptions o) override {
    check_tensor("all_reduce", "tensor", t, TensorPlace::cpu);
    check_reduce("all_reduce", t.dtype(), op);
    ReduceFn fn = make_reduce(t.dtype(), op);
    const DType dt = t.dtype();
    return enqueue("all_reduce", t, t, -1, o, [=, this](Context& c, Millis tmo, uint32_t tag) {
      const size_t n = static_cast<size_t>(t.numel());
      if (c.shm && n > 0) {
        c.shm->all_reduce(t.data_ptr(), n, itemsize(dt), shm_kind(1, op, dt), fn, tmo);
      } else if (c.size > 1 && n > 0 && n * itemsize(dt) * static_cast<size_t>(c.size - 1) <= direct_allreduce_bytes()) {
        direct_allreduce(c, t.data_ptr(), n, itemsize(dt), fn, tmo, tag);
      } else if (c.size > 1 && n > 0) {
        gloo::AllreduceOptions opts(c.ctx);
        if (const size_t seg = ring_segment_bytes()) opts.setMaxSegmentSize(seg);
        with_width(itemsize(dt), [&](auto w) {
          opts.setOutput(static_cast<decltype(w)*>(t.data_ptr()), n);
        });
        opts.setReduceFunction(fn);
        opts.setTag(tag);
        opts.setTimeout(tmo);
        gloo::allreduce(opts);
      }
      if (op == ReduceOp::avg && n > 0) divide(dt, t.data_ptr(), n, c.size);
    });
  }

  WorkPtr all_gather_single(const Tensor& out, const Tensor& in, CallOptions o) override {
    check_tensor("all_gather_single", "output", out, TensorPlace::cpu);
    check_tensor("all_gather_single", "input", in, TensorPlace::cpu);
    check_same_dtype("all_gather_single", out, in);
    KILN_CHECK(out.numel() == in.numel() * size_, "all_gather_single: output has ", out.numel(),
               " elements; expected world size ", size_, " x input's ", in.numel());
    return enqueue("all_gather", in, out, -1, o, [=](Context& c, Millis tmo, uint32_t tag) {
      const size_t bytes = in.nbytes();
      auto* slot = static_cast<uint8_t*>(out.data_ptr()) + bytes * static_cast<size_t>(c.rank);
      if (bytes == 0) return;
      if (slot != in.data_ptr()) std::memmove(slot, in.data_ptr(), bytes);  // (in may overlap out)
      if (c.shm) {  // in place: this rank's part of out is its input
        c.shm->all_gather(slot, out.data_ptr(), static_cast<size_t>(in.numel()), itemsize(in.dtype()),
                          shm_kind(2, ReduceOp::sum, in.dtype()), tmo);
        return;
      }
      if (c.size == 1) return;
      gloo::AllgatherOptions opts(c.ctx);
      opts.setOutput(static_cast<uint8_t*>(out.data_ptr()), bytes * static_cast<size_t>(c.size));
      opts.setTag(tag);
      opts.setTimeout(tmo);
      gloo::allgather(opts);
    });
  }

  WorkPtr reduce_scatter_single(const Tensor& out, const Tensor& in, ReduceOp op, CallOptions o) override {
    check_tensor("reduce_scatter_single", "output", out, TensorPlace::cpu);
    check_tensor("reduce_scatter_single", "input", in, TensorPlace::cpu);
    check_same_dtype("reduce_scatter_single", out, in);
    check_reduce("reduce_scatter_single", in.dtype(), op);
    KILN_CHECK(in.numel() == out.numel() * size_, "reduce_scatter_single: input has ", in.numel(),
               " elements; expected world size ", size_, " x output's ", out.numel(),
               in.numel() % size_ ? " (the input does not divide by the world size)" : "");
    ReduceFn fn = make_reduce(in.dtype(), op);
    const DType dt = in.dtype();
    return enqueue("reduce_scatter", in, out, -1, o, [=](Context& c, Millis tmo, uint32_t tag) {
      const size_t n = static_cast<size_t>(out.numel());
      const size_t chunk = out.nbytes();
      if (n == 0) return;
      if (c.size == 1) {
        std::memmove(out.data_ptr(), in.data_ptr(), chunk);
      } else if (c.shm) {
        // An output that overlaps the input anywhere but this rank's own part reads a copy of it.
        const auto* ib = static_cast<const uint8_t*>(in.data_ptr());
        const auto* ob = static_cast<const uint8_t*>(out.data_ptr());
        const void* src = in.data_ptr();
        if (ob < ib + in.nbytes() && ib < ob + chunk && ob != ib + chunk * static_cast<size_t>(c.rank)) {
          uint8_t* copy = c.scratch->get(in.nbytes());
          std::memcpy(copy, ib, in.nbytes());
          src = copy;
        }
        c.shm->reduce_scatter(src, out.data_ptr(), n, itemsize(dt), shm_kind(3, op, dt), fn, tmo);
      } else {
        uint8_t* recv = c.scratch->get(chunk * static_cast<size_t>(c.size));
        gloo::AlltoallOptions opts(c.ctx);
        opts.setInput(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
        opts.setOutput(recv, chunk * static_cast<size_t>(c.size));
        opts.setTag(tag);
        opts.setTimeout(tmo);
        gloo::alltoall(opts);
        // Rank order 0, 1, ..., size-1: every rank's chunk is reduced in the same order.
        std::memcpy(out.data_ptr(), recv, chunk);
        for (int r = 1; r < c.size; ++r) fn(out.data_ptr(), out.data_ptr(), recv + chunk * r, n);
      }
      if (op == ReduceOp::avg) divide(dt, out.data_ptr(), n, c.size);
    });
  }

  WorkPtr all_to_all_single(const Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                            const std::vector<int64_t>& in_splits, CallOptions o) override {
    check_tensor("all_to_all_single", "output", out, TensorPlace::cpu);
    check_tensor("all_to_all_single", "input", in, TensorPlace::cpu);
    check_same_dtype("all_to_all_single", out, in);
    const auto oc = all_to_all_counts("output", out, out_splits, size_);
    const auto ic = all_to_all_counts("input", in, in_splits, size_);
    KILN_CHECK(out.numel() == 0 || in.numel() == 0 || out.data_ptr() != in.data_ptr(),
               "all_to_all_single: output and input are the same memory (it cannot run in place)");
    const size_t item = itemsize(in.dtype());
    return enqueue("all_to_all", in, out, -1, o, [=](Context& c, Millis tmo, uint32_t tag) {
      if (c.size == 1) {
        KILN_CHECK(oc[0] == ic[0], "all_to_all_single: output split ", oc[0], " != input split ", ic[0]);
        if (ic[0] > 0) std::memcpy(out.data_ptr(), in.data_ptr(), in.nbytes());
        return;
      }
      if (in.numel() == 0 && out.numel() == 0) return;
      std::vector<int64_t> ib, ob;
      for (auto v : ic) ib.push_back(v * static_cast<int64_t>(item));
      for (auto v : oc) ob.push_back(v * static_cast<int64_t>(item));
      // Gloo refuses null buffers: point empty sides at a byte of scratch.
      uint8_t scratch = 0;
      auto* ip = in.numel() ? static_cast<uint8_t*>(in.data_ptr()) : &scratch;
      auto* op = out.numel() ? static_cast<uint8_t*>(out.data_ptr()) : &scratch;
      gloo::AlltoallvOptions opts(c.ctx);
      opts.setInput(ip, ib);
      opts.setOutput(op, ob);
      opts.setTag(tag);
      opts.setTimeout(tmo);
      gloo::alltoallv(opts);
    });
  }

  WorkPtr broadcast(const Tensor& t, int root, CallOptions o) override {
    check_tensor("broadcast", "tensor", t, TensorPlace::cpu);
    check_rank("broadcast", "root", root, size_, rank_, true);
    return enqueue("broadcast", t, t, root, o, [=](Context& c, Millis tmo, uint32_t tag) {
      if (c.size == 1 || t.numel() == 0) return;
      gloo::BroadcastOptions opts(c.ctx);
      opts.setOutput(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(tmo);
      gloo::broadcast(opts);
    });
  }

  WorkPtr send(const Tensor& t, int dst, CallOptions o) override {
    check_tensor("send", "tensor", t, TensorPlace::cpu);
    check_rank("send", "dst", dst, size_, rank_, false);
    return enqueue_p2p("send", t, dst, p2p_slot(send_seq_, dst), o);
  }

  WorkPtr recv(const Tensor& t, int src, CallOptions o) override {
    check_tensor("recv", "tensor", t, TensorPlace::cpu);
    check_rank("recv", "src", src, size_, rank_, false);
    return enqueue_p2p("recv", t, src, p2p_slot(recv_seq_, src), o);
  }

  WorkPtr barrier(CallOptions o) override {
    return enqueue("barrier", Tensor(), Tensor(), -1, o, [](Context& c, Millis tmo, uint32_t tag) {
      if (c.size == 1) return;
      gloo::BarrierOptions opts(c.ctx);
      opts.setTag(tag);
      opts.setTimeout(tmo);
      gloo::barrier(opts);
    });
  }

  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name) override {
    const int new_rank = check_split(ranks, name, size_, rank_);
    check_usable("split");
    const std::string path = next_split_store_path(split_count_, name, ranks);
    auto child = std::make_shared<GlooCommunicator>(store_, new_rank, static_cast<int>(ranks.size()), name, options_,
                                                    0, prefix_ + "/" + path + "/g0",
                                                    split_members(members_, ranks));
    json::Value ev = json::Value::object();
    ev["event"] = "split";
    ev["comm"] = name_;
    ev["new_comm"] = name;
    ev["new_size"] = static_cast<int64_t>(ranks.size());
    rank_event(ev);
    return child;
  }

  void abort() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = "aborted by the caller";
    cv_.notify_all();
  }

 private:
  using Body = std::function<void(Context&, Millis, uint32_t)>;
  struct Pending {
    WorkPtr work;
    Body body;
    int64_t fr_id;
    int64_t seq;
    std::string op;
    std::string what;  // "all_reduce #3 of 'world' (12 elements of f32)"
    int64_t bytes;
  };

  static uint64_t p2p_slot(std::map<int, uint64_t>& seq, int peer) { return (uint64_t{1} << 40) | seq[peer]++; }

  void check_usable(const char* op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (successor_)
      throw PeerLost(detail::str_cat(op, ": communicator '", name_, "' (generation ", generation_,
                                     ") lost a peer: ", broken_, "; use the smaller communicator this carries"),
                     successor_, lost_);
    KILN_CHECK(broken_.empty(), op, ": communicator '", name_, "' is broken: ", broken_);
  }

  WorkPtr enqueue(const char* op, const Tensor& in, const Tensor& out, int peer, const CallOptions& o, Body body) {
    check_usable(op);
    const Millis tmo = o.timeout.value_or(options_.timeout);
    KILN_CHECK(tmo.count() > 0, op, ": timeout ", tmo.count(), " ms must be positive");
    const int64_t seq = ++seq_;
    OpRecord rec = describe_op(name_, rank_, size_, seq, op, in, out, peer, tmo);
    rec.entry.generation = generation_;
    auto work = std::make_shared<Work>(rec.what, tmo);
    work->set_on_wait([weak = weak_from_this(), w = work.get()] {
      if (auto self = weak.lock()) static_cast<GlooCommunicator*>(self.get())->run_inline(w);
    });
    const int64_t fr = FlightRecorder::instance().record(rec.entry);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({work, std::move(body), fr, seq, op, rec.what, in.defined() ? int64_t(in.nbytes()) : 0});
    }
    // A world of one waits for no peer: its op runs here at once when it is next in line and
    // nothing runs (run_inline checks; no hand-off to the worker, whose wake-up on a busy machine
    // can cost a scheduler tick).
    if (size_ == 1) run_inline(work.get());
    cv_.notify_all();
    return work;
  }

  // send / recv post at once and wait on their own thread: a send blocks until its peer posts
  // the matching recv, so on the one worker a ring of send-then-recv would deadlock. Their
  // slots never meet the collectives' tags. A failure fails the Work and breaks the communicator.
  WorkPtr enqueue_p2p(const char* op, const Tensor& t, int peer, uint64_t slot, const CallOptions& o) {
    check_usable(op);
    const Millis tmo = o.timeout.value_or(options_.timeout);
    KILN_CHECK(tmo.count() > 0, op, ": timeout ", tmo.count(), " ms must be positive");
    const int64_t seq = ++seq_;
    OpRecord rec = describe_op(name_, rank_, size_, seq, op, t, t, peer, tmo);
    rec.entry.generation = generation_;
    const std::string what = rec.what;
    auto work = std::make_shared<Work>(what, tmo);
    const int64_t fr = FlightRecorder::instance().record(rec.entry);
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ctx = ctx_;
      ++p2p_running_;
    }
    const bool is_send = std::string(op) == "send";
    // The thread is detached: what it holds (the tensor's storage, the Gloo context, the Work)
    // is released before it counts itself finished, so nothing of it outlives the communicator
    // (a storage freed after exit would reach an allocator already destroyed).
    std::thread([this, work, fr, ctx, t = Tensor(t), peer, slot, tmo, is_send, what]() mutable {
      work->start();
      FlightRecorder::instance().started(fr);
      try {
        if (t.numel() > 0) {
          KILN_CHECK(ctx != nullptr, what, ": the communicator's connections are closed");
          auto buf = ctx->createUnboundBuffer(t.data_ptr(), t.nbytes());
          if (is_send) {
            buf->send(peer, slot);
            buf->waitSend(tmo);
          } else {
            buf->recv(peer, slot);
            buf->waitRecv(tmo);
          }
        }
        FlightRecorder::instance().finished(fr, "completed");
        work->complete();
      } catch (const std::exception& ex) {
        const bool timed_out = std::string(ex.what()).find("Timed out") != std::string::npos;
        FlightRecorder::instance().finished(fr, timed_out ? "timed_out" : "error");
        const std::string msg = "rank " + std::to_string(rank_) + ": " + what + (timed_out ? " timed out" : " failed") +
                                ": " + ex.what();
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (broken_.empty()) broken_ = msg;
        }
        if (timed_out) work->fail(WorkState::timed_out, std::make_exception_ptr(CommTimeout(msg)));
        else work->fail(WorkState::error, std::make_exception_ptr(Error(msg)));
      }
      t = Tensor();
      ctx.reset();
      work.reset();
      std::lock_guard<std::mutex> lock(mu_);
      --p2p_running_;
      cv_.notify_all();
    }).detach();
    return work;
  }

  // Ops run one at a time in issue order, on the worker thread, or on the thread that waits for
  // one when it is next in line and nothing runs (run_inline): busy_ says one is running.
  void work_loop() {
    while (true) {
      Pending p;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !busy_ && (stopping_ || !queue_.empty()); });
        if (queue_.empty()) return;
        if (!take(p)) continue;
      }
      run(p);
    }
  }

  void run_inline(const Work* w) {
    Pending p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (busy_ || stopping_ || queue_.empty() || queue_.front().work.get() != w) return;
      if (!take(p)) return;
    }
    run(p);
  }

  // Pops the next op under mu_; false when it was failed at once (a broken communicator).
  bool take(Pending& p) {
    p = std::move(queue_.front());
    queue_.pop_front();
    if (!broken_.empty() || stopping_) {
      const std::string why = stopping_ ? "the communicator was destroyed" : broken_;
      FlightRecorder::instance().finished(p.fr_id, "error");
      if (successor_)
        p.work->fail(WorkState::error, std::make_exception_ptr(PeerLost(
            p.what + ": communicator '" + name_ + "' lost a peer: " + why, successor_, lost_)));
      else
        p.work->fail(WorkState::error, std::make_exception_ptr(Error(p.what + " not run: " + why)));
      return false;
    }
    busy_ = true;
    current_seq_ = p.seq;
    current_start_ = Clock::now();
    current_timeout_ = p.work->timeout();
    return true;
  }

  void run(Pending& p) {
    p.work->start();
    FlightRecorder::instance().started(p.fr_id);
    progress_->started(p.seq);
    if (trace_ops()) trace("op_start", p, 0);
    const auto t0 = Clock::now();
    try {
      std::shared_ptr<gloo::rendezvous::Context> ctx;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ctx = ctx_;
      }
      Context c{ctx, rank_, size_, &scratch_, shm_.get()};
      p.body(c, p.work->timeout(), static_cast<uint32_t>(p.seq));
      scratch_.trim();
      progress_->completed(p.seq);
      FlightRecorder::instance().finished(p.fr_id, "completed");
      if (trace_ops()) trace("op_end", p, std::chrono::duration<double>(Clock::now() - t0).count());
      clear_current();
      p.work->complete();
    } catch (const ShmPeerFailed& e) {  // a peer died, failed or left: an error here, whatever its words
      clear_current();
      on_failure(p, e.what(), /*peer_failed=*/true);
    } catch (const std::exception& e) {
      clear_current();
      on_failure(p, e.what());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }

  void clear_current() {
    std::lock_guard<std::mutex> lock(mu_);
    current_seq_ = 0;
  }

  void trace(const char* event, const Pending& p, double seconds) {
    json::Value ev = json::Value::object();
    ev["event"] = event;
    ev["comm"] = name_;
    ev["seq"] = p.seq;
    ev["op"] = p.op;
    ev["bytes"] = p.bytes;
    if (seconds > 0) ev["seconds"] = seconds;
    rank_event(ev);
  }

  void publish_progress() { progress_->publish(); }

  void on_failure(Pending& p, const std::string& cause, bool peer_failed = false) {
    std::string low = cause;
    std::transform(low.begin(), low.end(), low.begin(), ::tolower);
    const bool timed_out = !peer_failed && low.find("timed out") != std::string::npos;
    const WorkState st = timed_out ? WorkState::timed_out : WorkState::error;
    // Destroying the context closes every pair, so the peers fail now rather than at their timeout;
    // the peers waiting in the shared-memory segment are told.
    {
      std::lock_guard<std::mutex> lock(mu_);
      ctx_.reset();
    }
    if (shm_) shm_->abort_peers(detail::str_cat("rank ", rank_, ": ", p.what, timed_out ? " timed out" : " failed"));
    try {
      publish_progress();
    } catch (...) {
    }
    // Live peers publish their progress when they fail too: after a timeout they may still be
    // inside the op (wait a watchdog tick for their word); after an error (a peer's connection
    // closed, and this rank's context with it) every live peer fails at once, so a short wait
    // suffices and the failure is reported within ~0.3 s of the peer's death.
    const Millis settle = timed_out ? options_.watchdog_interval + Millis(100)
                                    : std::min<Millis>(options_.watchdog_interval + Millis(100), Millis(300));
    const std::string who = progress_->not_joined(p.seq, settle);
    std::ostringstream msg;
    msg << "rank " << rank_ << ": " << p.what;
    if (timed_out) msg << " timed out after " << p.work->timeout().count() << " ms";
    else msg << " failed";
    msg << ": " << who << "; gloo: " << cause;
    FlightRecorder::instance().finished(p.fr_id, timed_out ? "timed_out" : "error");
    const std::string dump = FlightRecorder::instance().dump(timed_out ? "timeout" : "error");
    json::Value ev = json::Value::object();
    ev["event"] = timed_out ? "timeout" : "error";
    ev["comm"] = name_;
    ev["seq"] = p.seq;
    ev["op"] = p.op;
    ev["message"] = msg.str();
    if (!dump.empty()) ev["flight_recorder"] = dump;
    rank_event(ev);
    const std::string dump_note = dump.empty() ? " (no flight-recorder dump: set KILN_FR_DUMP_DIR or --log-dir)"
                                               : " (flight recorder: " + dump + ")";
    if (options_.policy == FailurePolicy::abort) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        broken_ = msg.str();
      }
      json::Value ab = json::Value::object();
      ab["event"] = "abort";
      ab["comm"] = name_;
      ab["seq"] = p.seq;
      rank_event(ab);
      if (options_.abort_process) {
        std::fprintf(stderr,
                     "kiln dist: %s%s\nkiln dist: policy abort: exiting with status %d (kiln launch "
                     "--max-restarts restarts the job; KILN_DIST_POLICY=shrink continues with the survivors)\n",
                     msg.str().c_str(), dump_note.c_str(), kAbortExitCode);
        std::fflush(stderr);
        std::_Exit(kAbortExitCode);
      }
      if (timed_out) p.work->fail(st, std::make_exception_ptr(CommTimeout(msg.str() + dump_note)));
      else p.work->fail(st, std::make_exception_ptr(Error(msg.str() + dump_note)));
      return;
    }
    try {
      auto next = shrink();
      {
        std::lock_guard<std::mutex> lock(mu_);
        broken_ = msg.str();
        successor_ = next;
      }
      std::ostringstream lost;
      for (size_t i = 0; i < lost_.size(); ++i) lost << (i ? ", " : "") << lost_[i];
      p.work->fail(st, std::make_exception_ptr(PeerLost(
          msg.str() + dump_note + "; policy shrink: continuing without rank(s) " + lost.str() + " as '" + name_ +
              "' generation " + std::to_string(next->generation()) + " of " + std::to_string(next->size()) +
              " ranks",
          next, lost_)));
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        broken_ = msg.str();
      }
      p.work->fail(WorkState::error, std::make_exception_ptr(Error(msg.str() + "; shrink failed: " + e.what())));
    }
  }

  // The survivors agree on who is alive (survivors.h) and connect a smaller context.
  std::shared_ptr<Communicator> shrink() {
    const SurvivorDecision d =
        agree_on_survivors(*scoped_, generation_, rank_, size_, options_.shrink_window, name_);
    lost_ = d.lost;
    const int new_rank = d.new_rank;
    std::string decision;
    for (int r : d.members) decision += (decision.empty() ? "" : ",") + std::to_string(r);
    const std::vector<int>& members = d.members;
    const std::string root = prefix_.substr(0, prefix_.rfind("/g"));
    auto next = std::make_shared<GlooCommunicator>(store_, new_rank, static_cast<int>(members.size()), name_, options_,
                                                   generation_ + 1, root + "/g" + std::to_string(generation_ + 1),
                                                   split_members(members_, members));
    json::Value ev = json::Value::object();
    ev["event"] = "shrink";
    ev["comm"] = name_;
    ev["generation"] = generation_ + 1;
    ev["survivors"] = decision;
    ev["new_rank"] = new_rank;
    rank_event(ev);
    return next;
  }

  void tick() {
    publish_progress();
    if (FlightRecorder::take_dump_request()) {
      const std::string path = FlightRecorder::instance().dump("SIGUSR1");
      std::fprintf(stderr, "kiln dist: flight recorder dumped to %s\n",
                   path.empty() ? "(nowhere: set KILN_FR_DUMP_DIR)" : path.c_str());
    }
    // The backend's own timeout should have ended the operation: past it by 5 s, it is hung.
    std::unique_lock<std::mutex> lock(mu_);
    if (current_seq_ > 0 && Clock::now() > current_start_ + current_timeout_ + std::chrono::seconds(5) &&
        options_.policy == FailurePolicy::abort && options_.abort_process) {
      const int64_t seq = current_seq_;
      lock.unlock();
      const std::string dump = FlightRecorder::instance().dump("watchdog");
      std::fprintf(stderr, "kiln dist: rank %d: op #%lld of '%s' is past its timeout and gloo did not end it%s; "
                   "exiting with status %d\n", rank_, static_cast<long long>(seq), name_.c_str(),
                   dump.empty() ? "" : (" (flight recorder: " + dump + ")").c_str(), kAbortExitCode);
      std::fflush(stderr);
      std::_Exit(kAbortExitCode);
    }
  }

  std::shared_ptr<Store> store_;
  std::shared_ptr<PrefixStore> scoped_;
  int rank_, size_;
  std::string name_;
  CommOptions options_;
  int generation_;
  std::string prefix_;
  std::vector<int> members_;  // the job's rank of each rank (flight_recorder.h)
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;  // guarded by mu_ after construction
  std::unique_ptr<ShmCollectives> shm_;              // the segment (null: TCP only); the running op's
  std::string shm_off_;                              // why there is none
  int p2p_running_ = 0;                              // send / recv threads not yet finished
  Scratch scratch_;                                  // the running op's (one at a time: busy_)
  bool busy_ = false;                                // an op is running (guarded by mu_)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stopping_ = false;
  std::string broken_;
  std::shared_ptr<Communicator> successor_;
  std::vector<int> lost_;
  int64_t seq_ = 0;  // of the caller's thread
  std::map<int, uint64_t> send_seq_, recv_seq_;
  std::map<std::string, int> split_count_;
  int64_t current_seq_ = 0;
  Clock::time_point current_start_;
  Millis current_timeout_{0};
  std::unique_ptr<ProgressBoard> progress_;
  std::thread worker_;
  std::unique_ptr<Watchdog> watchdog_;
};

// Gloo's TCP pairs write without MSG_NOSIGNAL: a write to a peer that just died would kill this
// process with SIGPIPE before the failure could be reported (seen: the survivor of a killed
// rank dying of signal 13). A process that left SIGPIPE at its default ignores it from here on,
// as Python does, so the write fails with EPIPE and the op fails with Gloo's message; a handler
// the program installed is left alone.
void ignore_default_sigpipe() {
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL && !(old.sa_flags & SA_SIGINFO)) {
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    ::sigaction(SIGPIPE, &ign, nullptr);
  }
}

}  // namespace

std::shared_ptr<Communicator> new_gloo_communicator(std::shared_ptr<Store> store, int rank, int size,
                                                    const std::string& name, CommOptions options) {
  KILN_CHECK(!name.empty(), "gloo communicator: the name is empty");
  ignore_default_sigpipe();
  return std::make_shared<GlooCommunicator>(std::move(store), rank, size, name, options, 0,
                                            "kiln/comm/" + name + "/g0", root_members(rank, size));
}

}  // namespace kiln::dist
