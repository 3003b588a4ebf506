// CachingAllocator: the device-independent logic of kiln's GPU allocator, written against an
// injectable DeviceMemoryApi (pattern 9 of ARCHITECTURE.md) so that it is tested on CPU with a
// fake API (tests/core/caching_allocator_test.cpp); kernels/cuda/runtime.cu plugs cudaMalloc
// and cudaFree into it. Freed blocks are kept in a cache keyed by (stream, size) and handed
// out again without a system call:
//   - every request is rounded up to a multiple of 512 bytes (at least 512);
//   - small requests (< 1 MiB) reuse only a cached block of exactly the rounded size (size bins);
//   - large requests take the smallest cached block that fits (best fit) as long as it wastes
//     at most max(1 MiB, rounded/8) bytes, so a huge block is not tied up by a small request;
//   - a block remembers the stream it was allocated for and is reused only for that stream
//     (all kiln work of a device runs on its context stream, so reuse there is immediate);
//   - when the system allocation fails, the whole cache is returned to the system and the
//     allocation retried once before kiln::Error (naming the size) is thrown.
// Counters follow the CPU allocator's convention: current/peak count the REQUESTED bytes;
// reserved_bytes counts what is held from the system (live and cached blocks).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "kiln/core/allocator.h"

namespace kiln {

// The system calls a CachingAllocator makes. malloc returns nullptr when out of memory.
class DeviceMemoryApi {
 public:
  virtual ~DeviceMemoryApi() = default;
  virtual void* malloc(size_t nbytes) = 0;
  virtual void free(void* ptr) = 0;
  // The stream new blocks are used on (an opaque tag; nullptr where streams do not matter).
  virtual void* current_stream() { return nullptr; }
  // Sets nbytes at ptr to `byte`, queued on `stream` (current_stream's tag).
  virtual void memset(void* ptr, uint8_t byte, size_t nbytes, void* stream) = 0;
};

class CachingAllocator final : public Allocator {
 public:
  static constexpr size_t kRound = 512;
  static constexpr size_t kSmallLimit = size_t(1) << 20;  // requests below this are "small"

  // `api` must outlive the allocator; `name` prefixes error messages (e.g. "cuda:0").
  CachingAllocator(DeviceMemoryApi* api, std::string name);
  ~CachingAllocator() override;  // returns cached blocks; live blocks are the owners' business

  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  MemoryStats stats() const override;
  void reset_peak() override;
  void empty_cache() override;
  void fill(void* ptr, size_t nbytes, uint8_t byte) override;

  static size_t round_size(size_t nbytes) {
    return nbytes == 0 ? kRound : (nbytes + kRound - 1) / kRound * kRound;
  }
  int64_t cached_bytes() const;  // reserved but not in use

 private:
  struct Block {
    size_t size = 0;       // rounded size held from the system
    size_t requested = 0;  // what the caller asked for (counted in current/peak)
    void* stream = nullptr;
  };
  using FreeKey = std::pair<void*, size_t>;  // (stream, size), ordered for best fit
  void* take_cached(size_t rounded, void* stream);  // nullptr when no block fits
  void release_cache();                              // caller holds mu_

  DeviceMemoryApi* api_;
  std::string name_;
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  std::multimap<FreeKey, void*> free_;
  int64_t current_ = 0, peak_ = 0, reserved_ = 0, cached_ = 0;
  int64_t num_allocs_ = 0, num_system_allocs_ = 0;
};

}  // namespace kiln
