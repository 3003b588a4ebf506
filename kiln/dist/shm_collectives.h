// ShmCollectives: all_reduce, all_gather and reduce_scatter through one shared-memory segment
// for the ranks of a communicator that all run on one host (the Gloo backend's path for them
// there; NOTE [shared-memory collectives] in shm_collectives.cpp). Set up collectively through
// the store: every rank gets a segment, or none does (another host, KILN_GLOO_SHM=0, or any rank
// failing to create, size or map it: the reason is returned and the caller keeps its TCP path).
// A peer that dies (its process gone), fails or leaves (abort_peers, left) or does not arrive
// within the timeout ends the operation on the others with an Error naming it (ShmPeerFailed
// when the peer is to blame); ranks that call another op or size fail too. Nothing waits without
// a deadline. The system calls go through ShmApi, so tests make them fail.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/dist/store.h"

namespace kiln::dist {

// out[i] = a[i] op b[i] for n elements (out may be a).
using ReduceFn = std::function<void(void*, const void*, const void*, size_t)>;

// A peer died, failed or left: this rank is not to blame (not a timeout).
class ShmPeerFailed : public Error {
 public:
  using Error::Error;
};

// The system calls of a segment. Every call but alive() throws kiln::Error naming what failed.
class ShmApi {
 public:
  virtual ~ShmApi() = default;
  // Creates a new segment `name` (never an existing one) with `bytes` of memory reserved (so a
  // full /dev/shm fails here, not as SIGBUS on first touch) and maps it shared.
  virtual void* create(const std::string& name, size_t bytes) = 0;
  // Maps the existing segment `name`, which must hold `bytes` and belong to this user alone.
  virtual void* open(const std::string& name, size_t bytes) = 0;
  virtual void unmap(void* p, size_t bytes) = 0;
  virtual void unlink(const std::string& name) = 0;
  // Whether process `pid` of this host still runs (false once it exited, even unreaped).
  virtual bool alive(int pid) = 0;
};
ShmApi& system_shm_api();

class ShmCollectives {
 public:
  struct Options {
    size_t chunk_bytes = size_t{1} << 20;  // per rank and step (KILN_GLOO_SHM_CHUNK_BYTES)
    std::string host_id;                   // empty: this host's (hostname, boot id, namespaces)
    int pid = 0;                           // the pid peers watch (0: this process's; tests fake it)
  };
  // Collective over the `size` ranks that share `store`'s prefix: returns this rank's segment,
  // or null on every rank with the reason in *why_not. Throws when the store does (a peer that
  // never arrives: the store's timeout) or KILN_GLOO_SHM is malformed; rank 0 then tells the
  // others (they return null) and leaves nothing in /dev/shm.
  static std::unique_ptr<ShmCollectives> connect(Store& store, int rank, int size, const Options& options,
                                               ShmApi& api, std::string* why_not);
  ~ShmCollectives();
  ShmCollectives(const ShmCollectives&) = delete;
  ShmCollectives& operator=(const ShmCollectives&) = delete;

  // Each op: every rank calls it in the same order with the same n, item and `kind` (the
  // caller's tag of the op, reduction and dtype; a rank whose call differs fails them all, naming
  // both). Throws kiln::Error ("... timed out ...") when `timeout` passes first, naming the ranks
  // not arrived, or ShmPeerFailed at once when a peer's process is gone, it failed (abort_peers),
  // or it left (left()) before arriving; the segment is then unusable (every later call throws).
  // Reductions run over the ranks in rank order, ((r0 op r1) op r2) ..., the same bits on every
  // rank.
  //
  // all_reduce: `data` (n elements of `item` bytes) reduced over the ranks, in place.
  void all_reduce(void* data, size_t n, size_t item, uint32_t kind, const ReduceFn& fn,
                  std::chrono::milliseconds timeout);
  // all_gather: out (size x n elements) = every rank's `in` (n elements) in rank order; `in` may
  // be this rank's part of `out`, and must not overlap the rest of it. (n == 0 returns at once,
  // unchecked: callers skip empty ops on every rank alike.)
  void all_gather(const void* in, void* out, size_t n, size_t item, uint32_t kind, std::chrono::milliseconds timeout);
  // reduce_scatter: out (n elements) = the reduction over the ranks of part `rank` of their `in`
  // (size x n elements); `out` may be this rank's part of `in`, and must not overlap the rest.
  void reduce_scatter(const void* in, void* out, size_t n, size_t item, uint32_t kind, const ReduceFn& fn,
                      std::chrono::milliseconds timeout);
  // Ends the peers' waits in this segment with `why` (this rank failed elsewhere).
  void abort_peers(const std::string& why);
  // This rank will call no more (its communicator is going away): a peer that still waits for it
  // fails at once; peers waiting only for others are not disturbed.
  void left();

 private:
  ShmCollectives(ShmApi& api, void* base, size_t bytes, int rank, int size, size_t chunk);
  struct Header;
  Header* header() const;
  uint32_t* flag(int rank, int which) const;  // which: 0 arrived, 1 reduced
  uint8_t* in_slot(int rank) const;
  uint8_t* out_slot() const;
  // The running op: its name in messages, its call, its deadline.
  struct Call {
    const char* op;
    size_t n, item;
    uint32_t kind;
    std::chrono::steady_clock::time_point deadline;
    std::chrono::milliseconds timeout;
  };
  Call begin(const char* op, size_t n, size_t item, uint32_t kind, std::chrono::milliseconds timeout);
  // Posts this rank's input of step s and waits for everyone's (on the first step, then compares
  // the calls); finish posts that this rank is done with step s's slots and waits for everyone.
  void arrive(const Call& c, uint32_t s, bool first);
  // A new step with `bytes` of `part` as this rank's input: copied into its slot, then arrive().
  uint32_t stage(const Call& c, const uint8_t* part, size_t bytes, bool first);
  void finish(const Call& c, uint32_t s);
  // out (m elements) = every rank's input slot from byte `at` on, reduced in rank order.
  void reduce_slots(uint8_t* out, size_t at, size_t m, const ReduceFn& fn) const;
  // Waits until every rank's flag `which` reached `seq` (within the op's deadline).
  void wait_all(const Call& c, int which, uint32_t seq, const char* phase);
  void post(int which, uint32_t seq);
  [[noreturn]] void broken(const std::string& why, bool peer_failed);
  void mark(uint32_t state, const std::string& why);

  ShmApi& api_;
  void* base_;
  size_t bytes_;
  int rank_, size_;
  size_t chunk_;
  uint32_t seq_ = 0;
  std::string broken_;
  std::vector<int> pids_;
  int spins_;
};

}  // namespace kiln::dist
