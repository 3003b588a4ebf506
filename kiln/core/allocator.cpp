// The CPU allocator (64-byte aligned, counted) and the per-device allocator registry.
#include "kiln/core/allocator.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <new>

#include "kiln/core/error.h"

namespace kiln {
namespace {

constexpr size_t kCpuAlignment = 64;

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    KILN_CHECK(nbytes <= SIZE_MAX - kCpuAlignment, "cpu allocator: ", nbytes, " bytes cannot be allocated");  // no wrap below
    size_t rounded = (nbytes + kCpuAlignment - 1) / kCpuAlignment * kCpuAlignment;
    if (rounded == 0) rounded = kCpuAlignment;
    void* p = std::aligned_alloc(kCpuAlignment, rounded);
    KILN_CHECK(p != nullptr, "cpu allocator: out of memory allocating ", nbytes, " bytes");
    counters_.on_alloc(static_cast<int64_t>(nbytes));
    system_allocs_.fetch_add(1, std::memory_order_relaxed);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (!ptr) return;
    std::free(ptr);
    counters_.on_free(static_cast<int64_t>(nbytes));
  }
  MemoryStats stats() const override {
    MemoryStats s;
    s.current_bytes = counters_.current();
    s.peak_bytes = counters_.peak();
    s.reserved_bytes = s.current_bytes;
    s.num_allocs = counters_.allocs();
    s.num_system_allocs = system_allocs_.load();
    return s;
  }
  void reset_peak() override { counters_.reset_peak(); }
  void fill(void* ptr, size_t nbytes, uint8_t byte) override { std::memset(ptr, byte, nbytes); }

 private:
  MemoryCounters counters_;
  std::atomic<int64_t> system_allocs_{0};
};

}  // namespace

Allocator& allocator_for(const Device& d) {
  if (d.is_cpu()) {
    // NOTE: process-wide, as the memory it counts is, and never destroyed: a storage released
    // during static destruction (a tensor held by another static) still finds it.
    static CpuAllocator* cpu = new CpuAllocator;
    return *cpu;
  }
  check_device_available(d, "allocate");
  return cuda_caching_allocator(d.index);
}

MemoryStats memory_stats(const Device& d) { return allocator_for(d).stats(); }
void reset_peak_memory_stats(const Device& d) { allocator_for(d).reset_peak(); }
void empty_cache(const Device& d) { allocator_for(d).empty_cache(); }

}  // namespace kiln
