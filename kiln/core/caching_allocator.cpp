// CachingAllocator bodies (design in caching_allocator.h).
#include "kiln/core/caching_allocator.h"

#include <algorithm>

#include "kiln/core/error.h"

namespace kiln {

CachingAllocator::CachingAllocator(DeviceMemoryApi* api, std::string name) : api_(api), name_(std::move(name)) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cache();
}

void* CachingAllocator::take_cached(size_t rounded, void* stream) {
  auto it = free_.lower_bound(FreeKey{stream, rounded});
  if (it == free_.end() || it->first.first != stream) return nullptr;
  size_t size = it->first.second;
  if (rounded < kSmallLimit) {
    if (size != rounded) return nullptr;  // small blocks: exact size bins only
  } else {
    size_t slack = std::max(kSmallLimit, rounded / 8);
    if (size - rounded > slack) return nullptr;
  }
  void* p = it->second;
  free_.erase(it);
  cached_ -= static_cast<int64_t>(size);
  live_[p] = Block{size, 0, stream};
  return p;
}

void* CachingAllocator::allocate(size_t nbytes) {
  const size_t rounded = round_size(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* stream = api_->current_stream();
  void* p = take_cached(rounded, stream);
  if (!p) {
    p = api_->malloc(rounded);
    if (!p) {  // out of memory: give the cache back to the system and retry once
      release_cache();
      p = api_->malloc(rounded);
    }
    KILN_CHECK(p != nullptr, name_, " caching allocator: out of memory allocating ", nbytes, " bytes (",
               rounded, " rounded; ", current_, " bytes in use, ", reserved_, " reserved after freeing the cache)");
    ++num_system_allocs_;
    reserved_ += static_cast<int64_t>(rounded);
    live_[p] = Block{rounded, 0, stream};
  }
  live_[p].requested = nbytes;
  current_ += static_cast<int64_t>(nbytes);
  peak_ = std::max(peak_, current_);
  ++num_allocs_;
  return p;
}

void CachingAllocator::deallocate(void* ptr, size_t nbytes) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  KILN_CHECK(it != live_.end(), name_, " caching allocator: deallocate of a pointer it did not allocate");
  Block b = it->second;
  live_.erase(it);
  current_ -= static_cast<int64_t>(b.requested);
  free_.emplace(FreeKey{b.stream, b.size}, ptr);
  cached_ += static_cast<int64_t>(b.size);
}

void CachingAllocator::fill(void* ptr, size_t nbytes, uint8_t byte) {
  void* stream = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(ptr);
    KILN_CHECK(it != live_.end() && nbytes <= it->second.size, name_,
               " caching allocator: fill of memory it did not hand out (or past its block)");
    stream = it->second.stream;
  }
  api_->memset(ptr, byte, nbytes, stream);
}

void CachingAllocator::release_cache() {
  for (auto& [key, p] : free_) {
    api_->free(p);
    reserved_ -= static_cast<int64_t>(key.second);
  }
  free_.clear();
  cached_ = 0;
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cache();
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryStats s;
  s.current_bytes = current_;
  s.peak_bytes = peak_;
  s.reserved_bytes = reserved_;
  s.num_allocs = num_allocs_;
  s.num_system_allocs = num_system_allocs_;
  return s;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = current_;
}

int64_t CachingAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

}  // namespace kiln
