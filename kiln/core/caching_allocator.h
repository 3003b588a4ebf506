// CachingAllocator: the device-independent logic of kiln's GPU allocator, written against an
// injectable DeviceMemoryApi (pattern 9 of ARCHITECTURE.md) so that it is tested on CPU with a
// fake API (tests/core/caching_allocator_test.cpp); core/cuda/runtime.cu plugs cudaMalloc,
// cudaFree and CUDA events into it. Freed blocks are kept in one pool per stream and handed
// out again without a system call:
//   - every request is rounded up to a multiple of 512 bytes (at least 512);
//   - small requests (< 1 MiB) reuse only a cached block of exactly the rounded size (size bins);
//   - large requests take the smallest cached block that fits (best fit) as long as it wastes
//     at most max(1 MiB, rounded/8) bytes, so a huge block is not tied up by a small request;
//   - a block belongs to the stream that was current when it was allocated and goes back to
//     that stream's pool: work of one stream runs in order, so a block freed there is reused
//     there at once, before the queued work that read it has run;
//   - NOTE [deferred frees]: a block also used on another stream (record_stream, as PyTorch's
//     Tensor.record_stream) returns to its pool only after an event recorded on each such
//     stream at deallocate has completed; until then it is pending (held, in no pool).
//     Pending blocks are looked at (event_done, no host wait) at every allocate; empty_cache,
//     the out-of-memory retry and the destructor wait for them (synchronize_event);
//   - when the system allocation fails, the pending blocks are waited for, the whole cache is
//     returned to the system and the allocation retried once before kiln::Error (naming the
//     size) is thrown.
//   - NOTE [graph pools]: while a CUDA graph is captured (core/cuda_graph.h) nothing runs, and
//     every later replay writes the same addresses, so the memory the capture uses must stay
//     the graph's. Between begin_allocate_to_pool(P) and end_allocate_to_pool(), every
//     allocation is taken from private pool P (its cached blocks, else the system), and every
//     block freed goes to P, whichever pool it came from (the captured kernels may read it at
//     replay). A block freed during the capture that another stream used (record_stream) is not
//     handed out again within the capture (the graph's branches may still read it) and joins P at
//     its end; no event is recorded while capturing (CUDA refuses to query one recorded then). A
//     block of another graph's pool that is still open stays that pool's (its graph writes it;
//     released while the later graph lives, that pool would free memory the later graph reads:
//     release graphs in the reverse order of their captures; graphs sharing one pool, as the
//     trainer's two do, release it together).
//     After the capture, blocks of P still go back to P when freed; only another capture into P
//     takes them. release_pool(P) gives P's cached blocks back to the system; its live blocks go
//     to the allocator's own pools when freed. empty_cache and the out-of-memory retry leave the
//     graph pools alone, and a capture that runs out of memory fails without freeing the cache
//     (freeing waits for the device, which a capture forbids). Every allocation on the device
//     goes to P while it is captured, whichever thread or stream asks: capture from one thread,
//     with nothing else allocating on that device meanwhile. Pool 0 is the allocator's own.
// Counters follow the CPU allocator's convention: current/peak count the REQUESTED bytes of
// live blocks (a pending block is not live); reserved_bytes counts what is held from the
// system (live, pending and cached blocks).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kiln/core/allocator.h"

namespace kiln {

// The system calls a CachingAllocator makes. Streams and events are opaque tags (cudaStream_t,
// cudaEvent_t on CUDA). Every call but malloc throws kiln::Error on failure.
class DeviceMemoryApi {
 public:
  virtual ~DeviceMemoryApi() = default;
  virtual void* malloc(size_t nbytes) = 0;  // nullptr when out of memory
  virtual void free(void* ptr) = 0;
  // The stream new blocks are used on (nullptr where streams do not matter).
  virtual void* current_stream() { return nullptr; }
  // Sets nbytes at ptr to `byte`, queued on `stream` (current_stream's tag).
  virtual void memset(void* ptr, uint8_t byte, size_t nbytes, void* stream) = 0;
  // NOTE [deferred frees]: an event recorded now on `stream` (its work queued so far), whether
  // it has completed (no host wait), a host wait for it, and giving it back.
  virtual void* record_event(void* stream) = 0;
  virtual bool event_done(void* event) = 0;
  virtual void synchronize_event(void* event) = 0;
  virtual void release_event(void* event) = 0;
};

class CachingAllocator final : public Allocator {
 public:
  static constexpr size_t kRound = 512;
  static constexpr size_t kSmallLimit = size_t(1) << 20;  // requests below this are "small"

  // `api` must outlive the allocator; `name` prefixes error messages (e.g. "cuda:0").
  CachingAllocator(DeviceMemoryApi* api, std::string name);
  // Waits for pending blocks and returns them and the cached ones; live blocks are the owners'.
  ~CachingAllocator() override;

  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  MemoryStats stats() const override;
  void reset_peak() override;
  void empty_cache() override;
  void fill(void* ptr, size_t nbytes, uint8_t byte) override;
  // The live block at `ptr` is also used by work queued on `stream` (NOTE [deferred frees]).
  // Its own stream, or a stream named twice, adds nothing.
  void record_stream(void* ptr, const Stream& stream) override;

  static size_t round_size(size_t nbytes) {
    return nbytes == 0 ? kRound : (nbytes + kRound - 1) / kRound * kRound;
  }
  int64_t cached_bytes() const;   // reserved but not in use (in a pool or pending)
  int64_t pending_bytes() const;  // the part of cached_bytes waiting for other streams' events

  // NOTE [graph pools]. Pool ids are the caller's (nonzero, never used again after release).
  using PoolId = uint64_t;
  void begin_allocate_to_pool(PoolId pool);  // kiln::Error while another pool is being allocated to
  void end_allocate_to_pool();
  void release_pool(PoolId pool);
  int64_t pool_cached_bytes(PoolId pool) const;  // cached in `pool` (and deferred until its capture ends)

 private:
  struct Block {
    size_t size = 0;       // rounded size held from the system
    size_t requested = 0;  // what the caller asked for (counted in current/peak)
    void* stream = nullptr;          // the stream it was allocated on: its pool
    PoolId pool = 0;                 // NOTE [graph pools]: 0, or the graph pool it belongs to
    std::vector<void*> uses;         // other streams that use it (record_stream)
  };
  struct Pending {
    void* ptr = nullptr;
    size_t size = 0;
    void* stream = nullptr;
    PoolId pool = 0;
    std::vector<void*> events;  // not yet seen complete, one per stream of Block::uses
  };
  using Pool = std::multimap<size_t, void*>;  // size -> block, ordered for best fit
  using StreamPools = std::unordered_map<void*, Pool>;  // one per stream
  void* take_cached(size_t rounded, void* stream, PoolId pool);  // nullptr when no block fits
  void to_pool(void* ptr, size_t size, void* stream, PoolId pool);
  void collect_pending(bool wait);  // moves the blocks whose events completed to their pools
  void release_cache();             // caller holds mu_; pending blocks are waited for first
  void free_pool(StreamPools& pools);  // caller holds mu_: every cached block to the system
  bool pool_open(PoolId pool) const;   // caller holds mu_: pool 0, or a graph pool not yet released

  DeviceMemoryApi* api_;
  std::string name_;
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  std::unordered_map<PoolId, StreamPools> pools_;  // NOTE [graph pools]: pools_[0] is the allocator's own
  std::vector<Pending> pending_;           // in deallocate order
  PoolId capturing_ = 0;                   // the pool allocated to now (0: none)
  std::vector<Pending> capture_deferred_;  // freed during the capture after another stream's use
  std::vector<PoolId> open_pools_;         // graph pools not yet released
  int64_t current_ = 0, peak_ = 0, reserved_ = 0, pooled_ = 0, pending_bytes_ = 0;
  int64_t num_allocs_ = 0, num_system_allocs_ = 0;
};

}  // namespace kiln
