// The NCCL backend (nccl_backend.h): host code over NcclApi / CudaApi, no CUDA or NCCL headers.
#include "kiln/dist/nccl_backend.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "kiln/dist/dist_log.h"
#include "kiln/dist/flight_recorder.h"
#include "kiln/dist/progress.h"
#include "kiln/dist/survivors.h"
#include "kiln/dist/watchdog.h"

namespace kiln::dist {

using Clock = std::chrono::steady_clock;

namespace {

NcclDtype nccl_dtype(const char* op, DType dt) {
  switch (dt) {
    case DType::f32: return NcclDtype::f32;
    case DType::f64: return NcclDtype::f64;
    case DType::f16: return NcclDtype::f16;
    case DType::bf16: return NcclDtype::bf16;
    case DType::i32: return NcclDtype::i32;
    case DType::i64: return NcclDtype::i64;
    case DType::u8: return NcclDtype::u8;
    default: fail(op, ": dtype ", dtype_name(dt), " cannot be reduced (expected f32, bf16, f16, f64, i32, i64 or u8)");
  }
}

// NCCL's reduction for `op` over `ranks` ranks. The mean over one rank is the sum (x / 1 == x,
// exactly): on the H200 machine's NCCL a one-rank ncclAvg reduce-scatter into a separate output left
// that output's last element unwritten at 40001 elements (every floating dtype; 33 were fine), so
// the one-rank mean is never asked of NCCL.
NcclRedOp nccl_op(ReduceOp op, int ranks) {
  switch (op) {
    case ReduceOp::sum: return NcclRedOp::sum;
    case ReduceOp::avg: return ranks == 1 ? NcclRedOp::sum : NcclRedOp::avg;
    case ReduceOp::min: return NcclRedOp::min;
    case ReduceOp::max: return NcclRedOp::max;
    case ReduceOp::product: return NcclRedOp::prod;
  }
  return NcclRedOp::sum;
}

struct InFlight {
  WorkPtr work;
  int64_t fr_id, seq;
  std::string op, what;
  CudaEventHandle start = nullptr, end = nullptr;
  std::optional<Clock::time_point> started;
};

}  // namespace

// What a Work's wait() calls to end the operations the device has finished, so that a waiter
// returns when its operation ends rather than at the watchdog's next tick (1 s by default).
// Works hold it weakly; the communicator's destructor detaches it before Parts goes.
struct NcclReaper {
  std::mutex mu;
  NcclCommunicator::Parts* parts = nullptr;  // null once detached
  void reap();
  // Makes the caller's stream wait for operation `seq`'s end event; false when it is no longer
  // in flight (ended, failed, or the communicator is gone).
  bool order_caller_after(int64_t seq);
};

struct NcclCommunicator::Parts {
  std::shared_ptr<NcclApi> nccl;
  std::shared_ptr<CudaApi> cuda;
  std::shared_ptr<Store> store;            // the job's store
  std::shared_ptr<PrefixStore> scoped;     // kiln/nccl/<name>/g<generation>
  std::string root;                        // kiln/nccl/<name> (or a split's)
  int rank = 0, size = 1, generation = 0;
  std::vector<int> members;  // the job's rank of each rank (flight_recorder.h); empty: root_members
  std::string name;
  CommOptions options;
  NcclBackendOptions backend;
  NcclCommHandle comm = nullptr;
  bool aborted = false;
  mutable std::mutex mu;  // guards everything below, and the comm's use by the watchdog
  std::deque<InFlight> inflight;
  std::string broken;
  std::shared_ptr<Communicator> successor;
  std::vector<int> lost;
  int64_t seq = 0;
  std::map<std::string, int> split_count;
  std::unique_ptr<ProgressBoard> progress;
  std::string pending_failure;  // a launch that failed under shrink: the watchdog handles it
  bool pending_timed_out = false;
  Tensor barrier_buf;
  std::unique_ptr<Watchdog> watchdog;
  std::shared_ptr<NcclReaper> reaper = std::make_shared<NcclReaper>();

  std::string nccl_error(NcclResult r) const {
    std::string s = std::string(nccl->error_string(r));
    const std::string last = comm ? nccl->last_error(comm) : "";
    return last.empty() ? s : s + " (" + last + ")";
  }

  // Polls comm's async error until it is not ncclInProgress; throws CommTimeout past deadline
  // and Error on a NCCL error.
  void wait_ready(const std::string& what, NcclResult r, NcclCommHandle c, Clock::time_point deadline, Millis budget) {
    if (r != NcclResult::success && r != NcclResult::in_progress)
      fail(what, ": ", nccl->error_string(r), c ? " (" + nccl->last_error(c) + ")" : "");
    while (true) {
      NcclResult st = NcclResult::success;
      const NcclResult q = nccl->comm_get_async_error(c, &st);
      if (q != NcclResult::success) fail(what, ": ncclCommGetAsyncError: ", nccl->error_string(q));
      if (st == NcclResult::success) return;
      if (st != NcclResult::in_progress) fail(what, ": ", nccl->error_string(st), " (", nccl->last_error(c), ")");
      if (Clock::now() >= deadline)
        throw CommTimeout(detail::str_cat(what, " stayed ncclInProgress for ", budget.count(),
                                          " ms (its timeout)"));
      std::this_thread::sleep_for(backend.poll_interval);
    }
  }

  void init_from_store() {
    const auto t0 = Clock::now();
    NcclUniqueIdBytes id{};
    if (rank == 0) {
      const NcclResult r = nccl->get_unique_id(&id);
      KILN_CHECK(r == NcclResult::success, "nccl communicator '", name, "': ncclGetUniqueId: ", nccl->error_string(r));
      scoped->set("unique_id", std::string(id.bytes, sizeof id.bytes));
    } else {
      const std::string v = scoped->get("unique_id");
      KILN_CHECK(v.size() == sizeof id.bytes, "nccl communicator '", name, "': the unique id in the store has ",
                 v.size(), " bytes (expected ", sizeof id.bytes, ")");
      std::copy(v.begin(), v.end(), id.bytes);
    }
    NcclCommConfig cfg;
    cfg.blocking = false;
    cfg.name = name;
    const NcclResult r = nccl->comm_init_rank_config(&comm, size, id, rank, cfg);
    try {
      wait_ready("nccl communicator '" + name + "': ncclCommInitRankConfig", r, comm, t0 + options.timeout,
                 options.timeout);
    } catch (...) {
      if (comm) {
        nccl->comm_abort(comm);  // a nonblocking init may be aborted; it is never destroyed after
        aborted = true;
      }
      throw;
    }
  }

  void log_init(const char* how) {
    json::Value ev = json::Value::object();
    ev["event"] = "init";
    ev["backend"] = "nccl";
    ev["comm"] = name;
    ev["comm_rank"] = rank;
    ev["comm_size"] = size;
    ev["generation"] = generation;
    ev["how"] = how;
    ev["nccl_version"] = nccl->version();
    rank_event(ev);
  }
};

std::shared_ptr<NcclCommunicator> new_nccl_communicator(std::shared_ptr<NcclApi> nccl, std::shared_ptr<CudaApi> cuda,
                                                        std::shared_ptr<Store> store, int rank, int size,
                                                        const std::string& name, CommOptions options,
                                                        NcclBackendOptions backend) {
  KILN_CHECK(nccl && cuda && store, "nccl communicator '", name, "': a null NcclApi, CudaApi or store");
  KILN_CHECK(!name.empty(), "nccl communicator: the name is empty");
  KILN_CHECK(size >= 1 && rank >= 0 && rank < size, "nccl communicator '", name, "': rank ", rank,
             " out of range [0, ", size, ")");
  KILN_CHECK(options.timeout.count() > 0, "nccl communicator '", name, "': timeout must be positive");
  auto p = std::make_unique<NcclCommunicator::Parts>();
  p->nccl = std::move(nccl);
  p->cuda = std::move(cuda);
  p->store = std::move(store);
  p->root = "kiln/nccl/" + name;
  p->rank = rank;
  p->size = size;
  p->name = name;
  p->options = options;
  p->backend = backend;
  p->scoped = std::make_shared<PrefixStore>(p->root + "/g0", p->store);
  p->scoped->set_timeout(options.timeout);
  p->init_from_store();
  p->log_init("ncclCommInitRankConfig");
  return std::make_shared<NcclCommunicator>(std::move(p));
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Parts> parts) : p_(std::move(parts)) {
  p_->reaper->parts = p_.get();
  p_->progress = std::make_unique<ProgressBoard>(p_->scoped, p_->rank, p_->size);
  if (p_->members.empty()) p_->members = root_members(p_->rank, p_->size);
  FlightRecorder::instance().joined({p_->name, p_->generation, p_->rank, p_->size, p_->members});
  FlightRecorder::install_sigusr1();
  if (p_->backend.start_watchdog)
    p_->watchdog = std::make_unique<Watchdog>(p_->options.watchdog_interval, [this] { watchdog_tick(); });
}

NcclCommunicator::~NcclCommunicator() {
  p_->watchdog.reset();
  {
    std::lock_guard<std::mutex> detach(p_->reaper->mu);
    p_->reaper->parts = nullptr;
  }
  std::lock_guard<std::mutex> lock(p_->mu);
  for (auto& f : p_->inflight) {
    f.work->fail(WorkState::error, std::make_exception_ptr(Error(f.what + ": the communicator was destroyed")));
    p_->cuda->event_destroy(f.start);
    p_->cuda->event_destroy(f.end);
  }
  if (!p_->comm || p_->aborted) return;  // never destroy after abort
  try {
    const NcclResult r = p_->nccl->comm_finalize(p_->comm);
    p_->wait_ready("ncclCommFinalize", r, p_->comm, Clock::now() + Millis(10000), Millis(10000));
    p_->nccl->comm_destroy(p_->comm);
  } catch (const std::exception&) {
    p_->nccl->comm_abort(p_->comm);
  }
}

int NcclCommunicator::rank() const { return p_->rank; }
int NcclCommunicator::size() const { return p_->size; }
const std::string& NcclCommunicator::name() const { return p_->name; }

Device NcclCommunicator::device() const {
  return p_->backend.place == TensorPlace::cuda ? cuda(p_->backend.device) : kCPU;
}
int NcclCommunicator::generation() const { return p_->generation; }
bool NcclCommunicator::aborted() const {
  std::lock_guard<std::mutex> lock(p_->mu);
  return p_->aborted;
}
size_t NcclCommunicator::in_flight() const {
  std::lock_guard<std::mutex> lock(p_->mu);
  return p_->inflight.size();
}

namespace {

// What runs one operation, given the communicator and the stream.
using Launch = std::function<NcclResult(NcclCommHandle, CudaStreamHandle)>;

}  // namespace

// The failure path, with p->mu held: every in-flight Work fails; then the policy runs.
static void fail_comm(NcclCommunicator::Parts& p, const InFlight* first, const std::string& cause, bool timed_out,
                      bool abort_comm = true) {
  const int64_t seq = first ? first->seq : p.seq;
  try {
    p.progress->publish();
  } catch (...) {
  }
  const std::string who = p.progress->not_joined(seq, p.options.watchdog_interval + Millis(100));
  std::ostringstream msg;
  msg << "rank " << p.rank << ": " << (first ? first->what : "communicator '" + p.name + "'")
      << (timed_out ? " timed out after " + std::to_string(p.options.timeout.count()) + " ms" : " failed") << ": "
      << who << "; nccl: " << cause;
  for (auto& f : p.inflight) FlightRecorder::instance().finished(f.fr_id, timed_out ? "timed_out" : "error");
  const std::string dump = FlightRecorder::instance().dump(timed_out ? "timeout" : "error");
  json::Value ev = json::Value::object();
  ev["event"] = timed_out ? "timeout" : "error";
  ev["comm"] = p.name;
  ev["seq"] = seq;
  ev["message"] = msg.str();
  if (!dump.empty()) ev["flight_recorder"] = dump;
  rank_event(ev);
  const std::string note = dump.empty() ? "" : " (flight recorder: " + dump + ")";
  // A nonblocking communicator's abort is what frees its kernels; it is never destroyed
  // afterwards. (Shrink keeps the parent live for ncclCommShrink, which aborts its operations.)
  if (abort_comm && p.comm && !p.aborted) {
    p.nccl->comm_abort(p.comm);
    p.aborted = true;
  }
  p.broken = msg.str();
  std::exception_ptr err;
  if (p.options.policy == FailurePolicy::abort) {
    json::Value ab = json::Value::object();
    ab["event"] = "abort";
    ab["comm"] = p.name;
    rank_event(ab);
    if (p.options.abort_process) {
      std::fprintf(stderr, "kiln dist: %s%s\nkiln dist: policy abort: ncclCommAbort done; exiting with status %d\n",
                   msg.str().c_str(), note.c_str(), kAbortExitCode);
      std::fflush(stderr);
      std::_Exit(kAbortExitCode);
    }
    err = timed_out ? std::make_exception_ptr(CommTimeout(msg.str() + note)) : std::make_exception_ptr(Error(msg.str() + note));
  } else {
    err = std::make_exception_ptr(Error(msg.str() + note + "; shrink failed"));
  }
  for (auto& f : p.inflight) {
    f.work->fail(timed_out ? WorkState::timed_out : WorkState::error, err);
    p.cuda->event_destroy(f.start);
    p.cuda->event_destroy(f.end);
  }
  p.inflight.clear();
}

// Starts the clock of the operations at the front that the device has begun and completes those
// it has finished, in order (p.mu held).
static void reap_finished(NcclCommunicator::Parts& p, Clock::time_point now) {
  while (!p.inflight.empty()) {
    InFlight& f = p.inflight.front();
    if (!f.started) {
      if (!p.cuda->event_query(f.start)) return;  // its clock starts when the device starts it
      f.started = now;
      f.work->start();
      FlightRecorder::instance().started(f.fr_id);
      p.progress->started(f.seq);
    }
    if (!p.cuda->event_query(f.end)) return;
    FlightRecorder::instance().finished(f.fr_id, "completed");
    p.progress->completed(f.seq);
    f.work->complete();
    p.cuda->event_destroy(f.start);
    p.cuda->event_destroy(f.end);
    p.inflight.pop_front();
  }
}

void NcclReaper::reap() {
  std::lock_guard<std::mutex> detach(mu);
  if (!parts) return;
  std::lock_guard<std::mutex> lock(parts->mu);
  if (!parts->broken.empty() || !parts->comm || !parts->pending_failure.empty()) return;  // the watchdog's
  reap_finished(*parts, Clock::now());
}

bool NcclReaper::order_caller_after(int64_t seq) {
  std::lock_guard<std::mutex> detach(mu);
  if (!parts) return false;
  std::lock_guard<std::mutex> lock(parts->mu);
  if (!parts->broken.empty() || !parts->comm) return false;
  for (const InFlight& f : parts->inflight) {
    if (f.seq != seq) continue;
    const int dev = parts->backend.device;
    parts->cuda->stream_wait_event(parts->cuda->caller_stream(dev), f.end);
    return true;
  }
  return false;
}

void NcclCommunicator::watchdog_tick() {
  std::shared_ptr<Communicator> next;
  {
    std::lock_guard<std::mutex> lock(p_->mu);
    try {
      p_->progress->publish();
    } catch (...) {
    }
    if (FlightRecorder::take_dump_request()) FlightRecorder::instance().dump("SIGUSR1");
    if (!p_->broken.empty() || !p_->comm) return;
    NcclResult st = NcclResult::success;
    p_->nccl->comm_get_async_error(p_->comm, &st);
    bool failed = false, timed_out = false;
    std::string cause;
    const InFlight* culprit = nullptr;
    if (st != NcclResult::success && st != NcclResult::in_progress) {
      failed = true;
      cause = "async error " + p_->nccl_error(st);
      culprit = p_->inflight.empty() ? nullptr : &p_->inflight.front();
    } else if (!p_->pending_failure.empty()) {
      failed = true;
      timed_out = p_->pending_timed_out;
      cause = p_->pending_failure;
      culprit = &p_->inflight.back();
    }
    const auto now = Clock::now();
    if (!failed) {
      reap_finished(*p_, now);
      InFlight* f = p_->inflight.empty() ? nullptr : &p_->inflight.front();
      if (f && f->started && now - *f->started > f->work->timeout()) {
        failed = timed_out = true;
        culprit = f;
        cause = "the operation did not complete on the device";
      }
    }
    if (!failed) return;
    if (p_->options.policy == FailurePolicy::shrink) {
      // Keep the Works to fail them with PeerLost once the survivors have a communicator.
      std::deque<InFlight> works;
      works.swap(p_->inflight);
      const InFlight first = culprit ? *culprit : InFlight{};
      const bool can_shrink = p_->nccl->has_shrink();
      fail_comm(*p_, culprit ? &first : nullptr, cause, timed_out, /*abort_comm=*/!can_shrink);  // logs, dumps
      std::vector<int> lost;
      std::string err;
      try {
        const SurvivorDecision d =
            agree_on_survivors(*p_->scoped, p_->generation, p_->rank, p_->size, p_->options.shrink_window, p_->name);
        lost = d.lost;
        auto np = std::make_unique<Parts>();
        np->nccl = p_->nccl;
        np->cuda = p_->cuda;
        np->store = p_->store;
        np->root = p_->root;
        np->rank = d.new_rank;
        np->size = static_cast<int>(d.members.size());
        np->generation = p_->generation + 1;
        np->members = split_members(p_->members, d.members);
        np->name = p_->name;
        np->options = p_->options;
        np->backend = p_->backend;
        np->scoped = std::make_shared<PrefixStore>(np->root + "/g" + std::to_string(np->generation), np->store);
        np->scoped->set_timeout(np->options.timeout);
        const char* how;
        if (can_shrink) {
          // NCCL_SHRINK_ABORT ends the parent's pending operations, then shrinks; the parent is
          // aborted afterwards (never destroyed).
          NcclCommConfig cfg;
          cfg.name = np->name;
          const auto t0 = Clock::now();
          const NcclResult r = p_->nccl->comm_shrink(p_->comm, lost, &np->comm, cfg, true);
          p_->nccl->comm_abort(p_->comm);
          p_->aborted = true;
          np->wait_ready("ncclCommShrink", r, np->comm, t0 + np->options.timeout, np->options.timeout);
          how = "ncclCommShrink";
        } else {
          np->init_from_store();
          how = "abort + ncclCommInitRankConfig (this NCCL has no ncclCommShrink)";
        }
        np->log_init(how);
        next = std::make_shared<NcclCommunicator>(std::move(np));
        p_->successor = next;
        p_->lost = lost;
        json::Value ev = json::Value::object();
        ev["event"] = "shrink";
        ev["comm"] = p_->name;
        ev["generation"] = p_->generation + 1;
        ev["how"] = how;
        rank_event(ev);
      } catch (const std::exception& e) {
        err = e.what();
      }
      for (auto& f : works) {
        if (next)
          f.work->fail(timed_out ? WorkState::timed_out : WorkState::error,
                       std::make_exception_ptr(PeerLost(p_->broken + "; policy shrink: continuing as generation " +
                                                            std::to_string(p_->generation + 1),
                                                        next, lost)));
        else
          f.work->fail(WorkState::error, std::make_exception_ptr(Error(p_->broken + "; shrink failed: " + err)));
        p_->cuda->event_destroy(f.start);
        p_->cuda->event_destroy(f.end);
      }
      return;
    }
    fail_comm(*p_, culprit, cause, timed_out);
  }
}

void NcclCommunicator::abort() {
  std::lock_guard<std::mutex> lock(p_->mu);
  if (p_->comm && !p_->aborted) {
    p_->nccl->comm_abort(p_->comm);
    p_->aborted = true;
  }
  if (p_->broken.empty()) p_->broken = "aborted by the caller";
  for (auto& f : p_->inflight) {
    f.work->fail(WorkState::error, std::make_exception_ptr(Error(f.what + ": the communicator was aborted")));
    p_->cuda->event_destroy(f.start);
    p_->cuda->event_destroy(f.end);
  }
  p_->inflight.clear();
}

namespace {

WorkPtr enqueue(NcclCommunicator::Parts& p, const char* op, const Tensor& in, const Tensor& out, int peer,
                const CallOptions& o, const Launch& launch) {
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.successor)
    throw PeerLost(detail::str_cat(op, ": communicator '", p.name, "' lost a peer: ", p.broken,
                                   "; use the smaller communicator this carries"),
                   p.successor, p.lost);
  KILN_CHECK(p.broken.empty(), op, ": communicator '", p.name, "' is broken: ", p.broken);
  const Millis tmo = o.timeout.value_or(p.options.timeout);
  KILN_CHECK(tmo.count() > 0, op, ": timeout ", tmo.count(), " ms must be positive");
  const int64_t seq = ++p.seq;
  OpRecord rec = describe_op(p.name, p.rank, p.size, seq, op, in, out, peer, tmo);
  rec.entry.generation = p.generation;
  auto work = std::make_shared<Work>(rec.what, tmo);
  work->set_progress([reaper = std::weak_ptr<NcclReaper>(p.reaper)] {
    if (auto r = reaper.lock()) r->reap();
  });
  InFlight f{work, FlightRecorder::instance().record(rec.entry), seq, op, rec.what};
  const int dev = p.backend.device;
  CudaStreamHandle stream = p.cuda->comm_stream(dev);
  // The collective runs after what the caller queued on its stream.
  CudaEventHandle ready = p.cuda->event_create(dev);
  p.cuda->event_record(ready, p.cuda->caller_stream(dev));
  p.cuda->stream_wait_event(stream, ready);
  p.cuda->event_destroy(ready);
  f.start = p.cuda->event_create(dev);
  f.end = p.cuda->event_create(dev);
  p.cuda->event_record(f.start, stream);
  const auto t0 = Clock::now();
  try {
    const NcclResult r = launch(p.comm, stream);
    p.wait_ready(rec.what, r, p.comm, t0 + tmo, tmo);
  } catch (const std::exception& ex) {
    const bool timed_out = dynamic_cast<const CommTimeout*>(&ex) != nullptr;
    p.inflight.push_back(f);
    if (p.options.policy == FailurePolicy::shrink) {
      p.pending_failure = ex.what();
      p.pending_timed_out = timed_out;
    } else {
      fail_comm(p, &p.inflight.back(), ex.what(), timed_out);
    }
    return work;
  }
  p.cuda->event_record(f.end, stream);
  // NOTE [waiting on the device]: under the abort policy wait_on_device() only orders the
  // caller's stream after the end event (the watchdog ends an operation that outlives its
  // timeout, and the process with it); under shrink the caller must meet the failure at its
  // wait to redo the step on the smaller communicator, so the host waits there.
  if (p.options.policy == FailurePolicy::abort)
    work->set_device_wait([reaper = std::weak_ptr<NcclReaper>(p.reaper), seq] {
      auto r = reaper.lock();
      return r && r->order_caller_after(seq);
    });
  p.inflight.push_back(f);
  if (trace_ops()) {
    json::Value ev = json::Value::object();
    ev["event"] = "op_start";
    ev["comm"] = p.name;
    ev["seq"] = seq;
    ev["op"] = op;
    ev["bytes"] = in.defined() ? static_cast<int64_t>(in.nbytes()) : 0;
    rank_event(ev);
  }
  return work;
}

}  // namespace

WorkPtr NcclCommunicator::all_reduce(const Tensor& t, ReduceOp op, CallOptions o) {
  check_tensor("all_reduce", "tensor", t, p_->backend.place);
  check_reduce("all_reduce", t.dtype(), op);
  const NcclDtype dt = nccl_dtype("all_reduce", t.dtype());
  const size_t n = static_cast<size_t>(t.numel());
  return enqueue(*p_, "all_reduce", t, t, -1, o, [&, dt, n](NcclCommHandle c, CudaStreamHandle s) {
    return p_->nccl->all_reduce(t.data_ptr(), t.data_ptr(), n, dt, nccl_op(op, p_->size), c, s);
  });
}

WorkPtr NcclCommunicator::all_gather_single(const Tensor& out, const Tensor& in, CallOptions o) {
  check_tensor("all_gather_single", "output", out, p_->backend.place);
  check_tensor("all_gather_single", "input", in, p_->backend.place);
  check_same_dtype("all_gather_single", out, in);
  KILN_CHECK(out.numel() == in.numel() * p_->size, "all_gather_single: output has ", out.numel(),
             " elements; expected world size ", p_->size, " x input's ", in.numel());
  return enqueue(*p_, "all_gather", in, out, -1, o, [&](NcclCommHandle c, CudaStreamHandle s) {
    return p_->nccl->all_gather(in.data_ptr(), out.data_ptr(), in.nbytes(), NcclDtype::u8, c, s);
  });
}

WorkPtr NcclCommunicator::reduce_scatter_single(const Tensor& out, const Tensor& in, ReduceOp op, CallOptions o) {
  check_tensor("reduce_scatter_single", "output", out, p_->backend.place);
  check_tensor("reduce_scatter_single", "input", in, p_->backend.place);
  check_same_dtype("reduce_scatter_single", out, in);
  check_reduce("reduce_scatter_single", in.dtype(), op);
  KILN_CHECK(in.numel() == out.numel() * p_->size, "reduce_scatter_single: input has ", in.numel(),
             " elements; expected world size ", p_->size, " x output's ", out.numel(),
             in.numel() % p_->size ? " (the input does not divide by the world size)" : "");
  const NcclDtype dt = nccl_dtype("reduce_scatter_single", in.dtype());
  return enqueue(*p_, "reduce_scatter", in, out, -1, o, [&, dt](NcclCommHandle c, CudaStreamHandle s) {
    return p_->nccl->reduce_scatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), dt,
                                    nccl_op(op, p_->size), c, s);
  });
}

WorkPtr NcclCommunicator::all_to_all_single(const Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                                            const std::vector<int64_t>& in_splits, CallOptions o) {
  check_tensor("all_to_all_single", "output", out, p_->backend.place);
  check_tensor("all_to_all_single", "input", in, p_->backend.place);
  check_same_dtype("all_to_all_single", out, in);
  const auto oc = all_to_all_counts("output", out, out_splits, p_->size);
  const auto ic = all_to_all_counts("input", in, in_splits, p_->size);
  const size_t item = itemsize(in.dtype());
  return enqueue(*p_, "all_to_all", in, out, -1, o, [&, oc, ic, item](NcclCommHandle c, CudaStreamHandle s) {
    NcclResult r = p_->nccl->group_start();
    if (r != NcclResult::success) return r;
    size_t ioff = 0, ooff = 0;
    for (int j = 0; j < p_->size; ++j) {
      const size_t ib = static_cast<size_t>(ic[j]) * item, ob = static_cast<size_t>(oc[j]) * item;
      if (ib) r = p_->nccl->send(static_cast<const char*>(in.data_ptr()) + ioff, ib, NcclDtype::u8, j, c, s);
      if (r == NcclResult::success && ob)
        r = p_->nccl->recv(static_cast<char*>(out.data_ptr()) + ooff, ob, NcclDtype::u8, j, c, s);
      if (r != NcclResult::success && r != NcclResult::in_progress) break;
      ioff += ib;
      ooff += ob;
    }
    const NcclResult e = p_->nccl->group_end();
    return r == NcclResult::success || r == NcclResult::in_progress ? e : r;
  });
}

WorkPtr NcclCommunicator::broadcast(const Tensor& t, int root, CallOptions o) {
  check_tensor("broadcast", "tensor", t, p_->backend.place);
  check_rank("broadcast", "root", root, p_->size, p_->rank, true);
  return enqueue(*p_, "broadcast", t, t, root, o, [&, root](NcclCommHandle c, CudaStreamHandle s) {
    return p_->nccl->broadcast(t.data_ptr(), t.data_ptr(), t.nbytes(), NcclDtype::u8, root, c, s);
  });
}

WorkPtr NcclCommunicator::send(const Tensor& t, int dst, CallOptions o) {
  check_tensor("send", "tensor", t, p_->backend.place);
  check_rank("send", "dst", dst, p_->size, p_->rank, false);
  return enqueue(*p_, "send", t, t, dst, o, [&, dst](NcclCommHandle c, CudaStreamHandle s) {
    return p_->nccl->send(t.data_ptr(), t.nbytes(), NcclDtype::u8, dst, c, s);
  });
}

WorkPtr NcclCommunicator::recv(const Tensor& t, int src, CallOptions o) {
  check_tensor("recv", "tensor", t, p_->backend.place);
  check_rank("recv", "src", src, p_->size, p_->rank, false);
  return enqueue(*p_, "recv", t, t, src, o, [&, src](NcclCommHandle c, CudaStreamHandle s) {
    return p_->nccl->recv(t.data_ptr(), t.nbytes(), NcclDtype::u8, src, c, s);
  });
}

WorkPtr NcclCommunicator::barrier(CallOptions o) {
  if (!p_->barrier_buf.defined())
    p_->barrier_buf = Tensor::empty({1}, DType::i32, device());
  const Tensor b = p_->barrier_buf;
  return enqueue(*p_, "barrier", Tensor(), Tensor(), -1, o, [this, b](NcclCommHandle c, CudaStreamHandle s) {
    return p_->nccl->all_reduce(b.data_ptr(), b.data_ptr(), 1, NcclDtype::i32, NcclRedOp::sum, c, s);
  });
}

std::shared_ptr<Communicator> NcclCommunicator::split(const std::vector<int>& ranks, const std::string& name) {
  const int new_rank = check_split(ranks, name, p_->size, p_->rank);
  std::string path;
  {
    std::lock_guard<std::mutex> lock(p_->mu);
    KILN_CHECK(p_->broken.empty(), "split: communicator '", p_->name, "' is broken: ", p_->broken);
    path = next_split_store_path(p_->split_count, name, ranks);
  }
  // A new communicator of the listed ranks through the store (only they call split, so no
  // collective ncclCommSplit over the parent is possible).
  auto child = new_nccl_communicator(p_->nccl, p_->cuda, std::make_shared<PrefixStore>(
                                         p_->root + "/g" + std::to_string(p_->generation) + "/" + path,
                                         p_->store),
                                     new_rank, static_cast<int>(ranks.size()), name, p_->options, p_->backend);
  child->p_->members = split_members(p_->members, ranks);  // the child noted root_members: correct it
  FlightRecorder::instance().joined({name, child->p_->generation, new_rank, child->p_->size, child->p_->members});
  json::Value ev = json::Value::object();
  ev["event"] = "split";
  ev["comm"] = p_->name;
  ev["new_comm"] = name;
  rank_event(ev);
  return child;
}

}  // namespace kiln::dist
