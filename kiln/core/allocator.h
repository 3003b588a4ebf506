// Allocators: every byte of tensor memory goes through one of these, which keep current and
// peak bytes per device. The CPU allocator hands out 64-byte aligned blocks; the CUDA one
// (CachingAllocator of kiln/core/caching_allocator.h, given cudaMalloc in core/cuda/runtime.cu)
// caches freed blocks in size bins so that a steady-state training loop never calls cudaMalloc.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kiln/core/device.h"
#include "kiln/core/dtype.h"
#include "kiln/core/stream.h"
#include "kiln/core/switches.h"  // the poison fill Tensor::empty applies (fill_uninitialized_memory)

namespace kiln {

struct MemoryStats {
  int64_t current_bytes = 0;   // bytes in live tensors (block sizes as handed out)
  int64_t peak_bytes = 0;      // maximum of current_bytes since the last reset
  int64_t reserved_bytes = 0;  // bytes held from the system (CUDA: live + cached)
  int64_t num_allocs = 0;      // allocate() calls since start
  int64_t num_system_allocs = 0;  // calls into malloc/cudaMalloc since start
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns nbytes (rounded by the allocator) of memory, or throws kiln::Error.
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns cached, unused memory to the system (no-op where nothing is cached).
  virtual void empty_cache() {}
  // Sets nbytes at ptr (memory from allocate) to `byte`, in order with the device's later work.
  virtual void fill(void* ptr, size_t nbytes, uint8_t byte) = 0;
  // The block at ptr (from allocate, not yet freed) is also used by work queued on `stream`:
  // after deallocate it is not handed out again before that work is done (NOTE [deferred
  // frees] in core/caching_allocator.h). A no-op where memory is used synchronously (the CPU).
  virtual void record_stream(void* ptr, const Stream& stream) {
    (void)ptr;
    (void)stream;
  }
};

// Counters shared by allocators: current and peak bytes, updated without locks.
class MemoryCounters {
 public:
  void on_alloc(int64_t n) {
    int64_t now = current_.fetch_add(n, std::memory_order_relaxed) + n;
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {}
    allocs_.fetch_add(1, std::memory_order_relaxed);
  }
  void on_free(int64_t n) { current_.fetch_sub(n, std::memory_order_relaxed); }
  void reset_peak() { peak_.store(current_.load()); }
  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  int64_t allocs() const { return allocs_.load(); }

 private:
  std::atomic<int64_t> current_{0}, peak_{0}, allocs_{0};
};

// The allocator for a device (process-wide, created on first use).
Allocator& allocator_for(const Device& d);
MemoryStats memory_stats(const Device& d);
void reset_peak_memory_stats(const Device& d);
void empty_cache(const Device& d);

// Provided by the CUDA backend (or its stub): the caching allocator of GPU `index`.
Allocator& cuda_caching_allocator(int index);

}  // namespace kiln
