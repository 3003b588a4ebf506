// ShmCollectives (shm_collectives.h): the segment's setup through the store, the chunked
// all_reduce, all_gather and reduce_scatter over it, the waits (spin, then a futex with a
// deadline, peers' liveness checked), and the POSIX shared-memory calls behind ShmApi.
//
// NOTE [shared-memory collectives]
// Gloo's ring sends 2(n-1)/n of the tensor through loopback TCP per rank, each byte copied into
// and out of the kernel. Ranks of one host can instead meet in one segment: an input slot of C
// bytes per rank and an output slot (C = KILN_GLOO_SHM_CHUNK_BYTES, default 1 MiB). Each op runs
// in steps, each in three phases: (1) every rank copies its step's input into its slot and posts
// `arrived`; (2) once all have arrived, each rank reads what it needs from every slot (all_reduce:
// reduces the r-th 1/n of the step over every slot in rank order into the output slot;
// all_gather: copies every slot to its place in the output; reduce_scatter, whose slots hold one
// run per destination rank: reduces its own run over every slot into its output) and posts
// `finished` (the flag named `reduced` below); (3) once all have finished, all_reduce copies the
// output slot back. One set of slots serves every step: a rank writes its input slot for step
// s+1 only after every rank posted `finished` for step s (nobody reads step s's slots any more),
// and writes into the output slot for step s+1 only after every rank posted `arrived` for it
// (everyone has copied step s out).
// The flags are 32-bit sequence numbers (compared by difference, so they wrap). Each rank also
// writes its call (element count, size, the caller's kind, which names the op) before its first
// `arrived` of an op, and every rank compares them after the first wait: ranks that disagree fail
// instead of mixing data. A waiter spins briefly, then sleeps on the flag's futex (shared across
// processes) in slices of at most 50 ms, checking between them the flag, the peers' states (one
// that failed ends every wait; one that left ends the waits for it), the deadline and, every
// 100 ms, that the peers it waits for still run (their pids, written in the segment). Posters
// wake the futex only when someone sleeps (a shared waiter count; flag and count are sequentially
// consistent, so a sleeper either sees the new flag or is woken). The segment is unlinked as soon
// as every rank has it mapped, or when the setup fails on rank 0, so nothing is left in /dev/shm
// but by a process killed inside the setup's few store round trips.
#include "kiln/dist/shm_collectives.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "kiln/core/env.h"
#include "kiln/core/error.h"

namespace kiln::dist {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

namespace {

constexpr uint64_t kMagic = 0x6b696c6e73686d31;  // "kilnshm1"
constexpr size_t kSlotsOffset = 64;
constexpr size_t kReasonBytes = 96;
constexpr uint32_t kFailed = 1, kLeft = 2;  // RankSlot::state

struct RankSlot {
  uint32_t arrived;
  uint32_t reduced;
  int32_t pid;
  uint32_t state;  // 0, kFailed (abort_peers) or kLeft (left)
  uint64_t n;      // the running op's call
  uint32_t item;
  uint32_t kind;
  char reason[kReasonBytes];
};
static_assert(sizeof(RankSlot) == 128);

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }
size_t data_offset(int size) { return round_up(kSlotsOffset + sizeof(RankSlot) * static_cast<size_t>(size), 4096); }
size_t segment_bytes(int size, size_t chunk) { return data_offset(size) + (static_cast<size_t>(size) + 1) * chunk; }

bool reached(uint32_t v, uint32_t seq) { return static_cast<int32_t>(v - seq) >= 0; }

std::string errno_text(const char* call, const std::string& name) {
  return detail::str_cat(call, "(", name, "): ", std::strerror(errno));
}

std::string read_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::string link_target(const char* path) {
  char buf[256];
  const ssize_t n = readlink(path, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

// Ranks share a segment only when they share the host and the namespaces that name it.
std::string this_host_id() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return detail::str_cat(name, "|", read_line("/proc/sys/kernel/random/boot_id"), "|",
                         link_target("/proc/self/ns/ipc"), "|", link_target("/proc/self/ns/mnt"), "|",
                         link_target("/proc/self/ns/pid"));
}

void futex_wait(uint32_t* addr, uint32_t expected, Millis for_at_most) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(for_at_most.count() / 1000);
  ts.tv_nsec = static_cast<long>((for_at_most.count() % 1000) * 1000000);
  if (syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0) == -1 && errno == ENOSYS)
    std::this_thread::sleep_for(std::chrono::microseconds(50));  // no futex: poll
}

void futex_wake(uint32_t* addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class PosixShm : public ShmApi {
 public:
  void* create(const std::string& name, size_t bytes) override {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) fail(errno_text("shm_open", name));
    auto undo = [&](const std::string& why) {
      close(fd);
      shm_unlink(name.c_str());
      fail(why);
    };
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) undo(errno_text("ftruncate", name));
    // Reserve the pages now: a full /dev/shm fails here rather than as SIGBUS at first touch.
    if (const int e = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0 && e != EOPNOTSUPP && e != ENOSYS) {
      errno = e;
      undo(detail::str_cat(errno_text("posix_fallocate", name), " (", bytes, " bytes; /dev/shm too small?)"));
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) undo(errno_text("mmap", name));
    close(fd);
    return p;
  }
  void* open(const std::string& name, size_t bytes) override {
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) fail(errno_text("shm_open", name));
    struct stat st {};
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
      close(fd);
      fail("shm segment ", name, " holds ", st.st_size, " bytes, expected ", bytes);
    }
    if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
      close(fd);
      fail("shm segment ", name, " belongs to uid ", st.st_uid, " with mode ", std::oct, (st.st_mode & 0777),
           ": not this user's alone");
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) fail(errno_text("mmap", name));
    return p;
  }
  void unmap(void* p, size_t bytes) override { munmap(p, bytes); }
  void unlink(const std::string& name) override {
    if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) fail(errno_text("shm_unlink", name));
  }
  bool alive(int pid) override {
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    // An exited process stays until its parent reaps it: a zombie is dead too.
    const std::string stat = read_line(("/proc/" + std::to_string(pid) + "/stat").c_str());
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat.size()) return true;  // no /proc: kill's word
    const char state = stat[paren + 2];
    return state != 'Z' && state != 'X';
  }
};

}  // namespace

ShmApi& system_shm_api() {
  static PosixShm api;  // stateless
  return api;
}

struct ShmCollectives::Header {
  uint64_t magic;
  uint64_t nonce;
  uint32_t size;
  uint32_t waiters;  // threads asleep on a flag's futex
  uint64_t chunk;
};

ShmCollectives::ShmCollectives(ShmApi& api, void* base, size_t bytes, int rank, int size, size_t chunk)
    : api_(api), base_(base), bytes_(bytes), rank_(rank), size_(size), chunk_(chunk) {
  static_assert(sizeof(Header) <= kSlotsOffset);
  // Spin before sleeping only where every rank can have a core of its own.
  spins_ = std::thread::hardware_concurrency() >= static_cast<unsigned>(2 * size) ? 20000 : 200;
}

ShmCollectives::~ShmCollectives() { api_.unmap(base_, bytes_); }

ShmCollectives::Header* ShmCollectives::header() const { return static_cast<Header*>(base_); }

namespace {
RankSlot* slot_of(void* base, int rank) {
  return reinterpret_cast<RankSlot*>(static_cast<uint8_t*>(base) + kSlotsOffset + sizeof(RankSlot) * rank);
}
}  // namespace

uint32_t* ShmCollectives::flag(int rank, int which) const {
  RankSlot* s = slot_of(base_, rank);
  return which == 0 ? &s->arrived : &s->reduced;
}

uint8_t* ShmCollectives::in_slot(int rank) const {
  return static_cast<uint8_t*>(base_) + data_offset(size_) + static_cast<size_t>(rank) * chunk_;
}

uint8_t* ShmCollectives::out_slot() const { return in_slot(size_); }

std::unique_ptr<ShmCollectives> ShmCollectives::connect(Store& store, int rank, int size, const Options& options,
                                                    ShmApi& api, std::string* why_not) {
  auto no = [&](const std::string& why) -> std::unique_ptr<ShmCollectives> {
    if (why_not) *why_not = why;
    return nullptr;
  };
  if (size < 2) return no("a world of one");
  const bool enabled = env_integer("KILN_GLOO_SHM", 0, 1, 1) != 0;  // a malformed value throws before any store traffic
  const int32_t pid = options.pid != 0 ? options.pid : static_cast<int32_t>(getpid());
  // A multiple of 64 that every rank's run of 8-byte elements divides (reduce_scatter's steps).
  const size_t chunk = round_up(std::max<size_t>(options.chunk_bytes, 64), 64 * static_cast<size_t>(size));
  store.set("shm/host/" + std::to_string(rank), options.host_id.empty() ? this_host_id() : options.host_id);
  // The segment as this rank holds it: unmapped, and on rank 0 unlinked, on every way out.
  std::string name;
  size_t bytes = 0;
  void* base = nullptr;
  struct Release {
    ShmApi& api;
    int rank;
    const std::string& name;
    void*& base;
    const size_t& bytes;
    bool unlinked = false, kept = false;
    void unlink() {
      if (rank == 0 && !name.empty() && !unlinked) {
        unlinked = true;
        try {
          api.unlink(name);
        } catch (const Error&) {
        }
      }
    }
    ~Release() {
      unlink();
      if (base && !kept) api.unmap(base, bytes);
    }
  } release{api, rank, name, base, bytes};

  std::string decision;
  if (rank == 0) {
    try {
      const std::string mine = store.get("shm/host/0");
      for (int r = 1; r < size && decision.empty(); ++r)
        if (store.get("shm/host/" + std::to_string(r)) != mine)
          decision = detail::str_cat("none:rank ", r, " runs on another host (or in other namespaces) than rank 0");
      if (decision.empty() && !enabled) decision = "none:KILN_GLOO_SHM=0";
      if (decision.empty()) {
        std::random_device rd;
        const uint64_t nonce = (uint64_t{rd()} << 32) ^ rd();
        std::ostringstream n;
        n << "/kiln-" << getpid() << "-" << std::hex << nonce;
        bytes = segment_bytes(size, chunk);
        try {
          base = api.create(n.str(), bytes);
          name = n.str();
          auto* h = static_cast<Header*>(base);
          h->nonce = nonce;
          h->size = static_cast<uint32_t>(size);
          h->chunk = chunk;
          h->magic = kMagic;
          slot_of(base, 0)->pid = pid;
          decision = detail::str_cat("seg:", chunk, ":", nonce, ":", name);
        } catch (const Error& e) {
          decision = detail::str_cat("none:rank 0 could not create the segment: ", e.what());
        }
      }
    } catch (const std::exception& e) {  // the others must not wait for a decision that never comes
      try {
        store.set("shm/decision", detail::str_cat("none:rank 0 failed setting it up: ", e.what()));
      } catch (...) {
      }
      throw;
    }
    store.set("shm/decision", decision);
  } else {
    decision = store.get("shm/decision");
  }
  if (decision.rfind("none:", 0) == 0) return no(decision.substr(5));
  // "seg:<chunk>:<nonce>:<name>"
  std::istringstream in(decision.substr(4));
  size_t seg_chunk = 0;
  uint64_t nonce = 0;
  char colon = 0;
  in >> seg_chunk >> colon >> nonce >> colon;
  std::string seg_name;
  std::getline(in, seg_name);
  bytes = segment_bytes(size, seg_chunk);
  std::string ok = "1";
  if (rank != 0) {
    try {
      base = api.open(seg_name, bytes);
      const auto* h = static_cast<const Header*>(base);
      if (h->magic != kMagic || h->nonce != nonce || h->size != static_cast<uint32_t>(size) || h->chunk != seg_chunk)
        ok = detail::str_cat("0:segment ", seg_name, " is not the one rank 0 made");
      else
        slot_of(base, rank)->pid = pid;
    } catch (const Error& e) {
      ok = detail::str_cat("0:", e.what());
    }
  }
  store.set("shm/ok/" + std::to_string(rank), ok);
  std::string failed;
  for (int r = 0; r < size; ++r) {
    const std::string v = store.get("shm/ok/" + std::to_string(r));
    if (v != "1" && failed.empty()) failed = detail::str_cat("rank ", r, " could not map it: ", v.substr(2));
  }
  release.unlink();  // every rank has it mapped (or gave up): nothing left behind in /dev/shm
  if (!failed.empty() || ok != "1") return no(failed);
  std::unique_ptr<ShmCollectives> s(new ShmCollectives(api, base, bytes, rank, size, seg_chunk));
  release.kept = true;
  for (int r = 0; r < size; ++r) s->pids_.push_back(slot_of(base, r)->pid);
  return s;
}

void ShmCollectives::broken(const std::string& why, bool peer_failed) {
  broken_ = why;
  if (peer_failed) throw ShmPeerFailed(why);
  fail(why);
}

void ShmCollectives::post(int which, uint32_t seq) {
  std::atomic_ref<uint32_t>(*flag(rank_, which)).store(seq, std::memory_order_seq_cst);
  if (std::atomic_ref<uint32_t>(header()->waiters).load(std::memory_order_seq_cst) > 0) futex_wake(flag(rank_, which));
}

void ShmCollectives::wait_all(const Call& c, int which, uint32_t seq, const char* phase) {
  const char* op = c.op;
  const char* step = which == 0 ? "arrive" : "finish";
  auto next_liveness = Clock::now() + Millis(100);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    std::atomic_ref<uint32_t> f(*flag(r, which));
    bool done = false;
    for (int i = 0; i < spins_ && !done; ++i) {
      done = reached(f.load(std::memory_order_acquire), seq);
      if (!done) cpu_relax();
    }
    while (!done) {
      // The flag first: a peer that posted it and then left (or failed later) must not fail a wait
      // it already ended.
      if ((done = reached(f.load(std::memory_order_acquire), seq))) break;
      for (int k = 0; k < size_; ++k) {
        RankSlot* s = slot_of(base_, k);
        const uint32_t state = k == rank_ ? 0 : std::atomic_ref<uint32_t>(s->state).load(std::memory_order_acquire);
        if (state == kFailed || (state == kLeft && k == r))
          broken(detail::str_cat("shared-memory ", op, ": rank ", k, state == kFailed ? " failed: " : " left: ",
                                 std::string(s->reason, strnlen(s->reason, kReasonBytes))),
                 true);
      }
      const auto now = Clock::now();
      if (now >= c.deadline) {
        std::string late;
        for (int k = 0; k < size_; ++k)
          if (k != rank_ && !reached(std::atomic_ref<uint32_t>(*flag(k, which)).load(), seq))
            late += (late.empty() ? "" : ", ") + std::to_string(k);
        broken(detail::str_cat("shared-memory ", op, " timed out after ", c.timeout.count(), " ms (", phase,
                               ") waiting for rank(s) ", late, " to ", step),
               false);
      }
      if (now >= next_liveness) {
        next_liveness = now + Millis(100);
        for (int k = 0; k < size_; ++k)
          if (k != rank_ && !reached(std::atomic_ref<uint32_t>(*flag(k, which)).load(), seq) && !api_.alive(pids_[k]))
            broken(detail::str_cat("shared-memory ", op, ": rank ", k, " (pid ", pids_[k], ") is gone (", phase, ")"),
                   true);
      }
      std::atomic_ref<uint32_t> waiters(header()->waiters);
      waiters.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t v = f.load(std::memory_order_seq_cst);
      done = reached(v, seq);
      if (!done) {
        const auto left = std::chrono::duration_cast<Millis>(c.deadline - now) + Millis(1);
        futex_wait(flag(r, which), v, std::min(left, Millis(50)));
        done = reached(f.load(std::memory_order_acquire), seq);
      }
      waiters.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
}

ShmCollectives::Call ShmCollectives::begin(const char* op, size_t n, size_t item, uint32_t kind, Millis timeout) {
  KILN_CHECK(broken_.empty(), "shared-memory ", op, ": unusable after an earlier failure: ", broken_);
  KILN_CHECK(item > 0 && chunk_ % (item * static_cast<size_t>(size_)) == 0, "shared-memory ", op, ": element size ",
             item, " x ", size_, " ranks does not divide the chunk of ", chunk_, " bytes");
  RankSlot* mine = slot_of(base_, rank_);
  mine->n = n;
  mine->item = static_cast<uint32_t>(item);
  mine->kind = kind;
  return Call{op, n, item, kind, Clock::now() + timeout, timeout};
}

void ShmCollectives::arrive(const Call& c, uint32_t s, bool first) {
  post(0, s);
  wait_all(c, 0, s, "inputs");
  if (!first) return;
  // Every rank's call is visible now: the same one, or nobody goes on.
  for (int r = 0; r < size_; ++r) {
    const RankSlot* o = slot_of(base_, r);
    if (o->n != c.n || o->item != c.item || o->kind != c.kind)
      broken(detail::str_cat("shared-memory ", c.op, ": rank ", r, " called it with ", o->n, " elements of ", o->item,
                             " bytes (kind ", o->kind, "), rank ", rank_, " with ", c.n, " of ", c.item, " (kind ",
                             c.kind, ")"),
             false);
  }
}

uint32_t ShmCollectives::stage(const Call& c, const uint8_t* part, size_t bytes, bool first) {
  const uint32_t s = ++seq_;
  std::memcpy(in_slot(rank_), part, bytes);
  arrive(c, s, first);
  return s;
}

void ShmCollectives::finish(const Call& c, uint32_t s) {
  post(1, s);
  wait_all(c, 1, s, "results");
}

void ShmCollectives::reduce_slots(uint8_t* out, size_t at, size_t m, const ReduceFn& fn) const {
  fn(out, in_slot(0) + at, in_slot(1) + at, m);
  for (int r = 2; r < size_; ++r) fn(out, out, in_slot(r) + at, m);
}

void ShmCollectives::all_reduce(void* data, size_t n, size_t item, uint32_t kind, const ReduceFn& fn, Millis timeout) {
  const Call c = begin("all_reduce", n, item, kind, timeout);
  const size_t per_chunk = chunk_ / item;
  auto* bytes = static_cast<uint8_t*>(data);
  for (size_t off = 0; off < n; off += per_chunk) {
    const size_t m = std::min(per_chunk, n - off);
    const uint32_t s = stage(c, bytes + off * item, m * item, off == 0);
    // This rank's part of the chunk, over every input in rank order.
    const size_t lo = m * static_cast<size_t>(rank_) / static_cast<size_t>(size_);
    const size_t hi = m * static_cast<size_t>(rank_ + 1) / static_cast<size_t>(size_);
    if (hi > lo) reduce_slots(out_slot() + lo * item, lo * item, hi - lo, fn);
    finish(c, s);
    std::memcpy(bytes + off * item, out_slot(), m * item);
  }
}

void ShmCollectives::all_gather(const void* in, void* out, size_t n, size_t item, uint32_t kind, Millis timeout) {
  const Call c = begin("all_gather", n, item, kind, timeout);
  const size_t per_chunk = chunk_ / item;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  for (size_t off = 0; off < n; off += per_chunk) {
    const size_t m = std::min(per_chunk, n - off);
    const uint32_t s = stage(c, src + off * item, m * item, off == 0);
    for (int r = 0; r < size_; ++r)
      if (r != rank_ || dst + (static_cast<size_t>(r) * n + off) * item != src + off * item)
        std::memcpy(dst + (static_cast<size_t>(r) * n + off) * item, in_slot(r), m * item);
    finish(c, s);  // every rank has read the slots: the next chunk may overwrite them
  }
}

void ShmCollectives::reduce_scatter(const void* in, void* out, size_t n, size_t item, uint32_t kind,
                                    const ReduceFn& fn, Millis timeout) {
  const Call c = begin("reduce_scatter", n, item, kind, timeout);
  // Per step, k elements of every rank's part: the slot holds size_ runs of k, rank r's run first
  // for r = 0 (the part rank r keeps).
  const size_t k = chunk_ / (item * static_cast<size_t>(size_));
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  for (size_t off = 0; off < n; off += k) {
    const size_t m = std::min(k, n - off);
    const uint32_t s = ++seq_;
    for (int r = 0; r < size_; ++r)
      std::memcpy(in_slot(rank_) + static_cast<size_t>(r) * k * item, src + (static_cast<size_t>(r) * n + off) * item,
                  m * item);
    arrive(c, s, off == 0);
    reduce_slots(dst + off * item, static_cast<size_t>(rank_) * k * item, m, fn);
    finish(c, s);
  }
}

void ShmCollectives::mark(uint32_t state, const std::string& why) {
  RankSlot* s = slot_of(base_, rank_);
  const size_t len = std::min(why.size(), kReasonBytes - 1);
  std::memcpy(s->reason, why.data(), len);
  s->reason[len] = '\0';
  std::atomic_ref<uint32_t>(s->state).store(state, std::memory_order_seq_cst);
  for (int k = 0; k < size_; ++k) {
    futex_wake(flag(k, 0));
    futex_wake(flag(k, 1));
  }
}

void ShmCollectives::abort_peers(const std::string& why) { mark(kFailed, why); }

void ShmCollectives::left() {
  if (std::atomic_ref<uint32_t>(slot_of(base_, rank_)->state).load() == 0)
    mark(kLeft, detail::str_cat("rank ", rank_, " destroyed its communicator"));
}

}  // namespace kiln::dist
