// CachingAllocator bodies (design in caching_allocator.h).
#include "kiln/core/caching_allocator.h"

#include <algorithm>

#include "kiln/core/error.h"

namespace kiln {

CachingAllocator::CachingAllocator(DeviceMemoryApi* api, std::string name) : api_(api), name_(std::move(name)) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    release_cache();
    for (Pending& b : capture_deferred_) to_pool(b.ptr, b.size, b.stream, b.pool);
    capture_deferred_.clear();
    for (auto& [pool, pools] : pools_) free_pool(pools);  // the graph pools' too (their graphs are gone)
  } catch (...) {  // a destructor must not throw: what could not be returned is lost with the device
  }
}

bool CachingAllocator::pool_open(PoolId pool) const {
  return pool == 0 || std::find(open_pools_.begin(), open_pools_.end(), pool) != open_pools_.end();
}

void* CachingAllocator::take_cached(size_t rounded, void* stream, PoolId pool_id) {
  auto pools = pools_.find(pool_id);
  if (pools == pools_.end()) return nullptr;
  auto pool = pools->second.find(stream);
  if (pool == pools->second.end()) return nullptr;
  auto it = pool->second.lower_bound(rounded);
  if (it == pool->second.end()) return nullptr;
  size_t size = it->first;
  if (rounded < kSmallLimit) {
    if (size != rounded) return nullptr;  // small blocks: exact size bins only
  } else {
    size_t slack = std::max(kSmallLimit, rounded / 8);
    if (size - rounded > slack) return nullptr;
  }
  void* p = it->second;
  pool->second.erase(it);
  pooled_ -= static_cast<int64_t>(size);
  live_[p] = Block{size, 0, stream, pool_id, {}};
  return p;
}

void CachingAllocator::to_pool(void* ptr, size_t size, void* stream, PoolId pool) {
  // a released graph pool's blocks come back to the allocator's own (NOTE [graph pools])
  if (!pool_open(pool)) pool = 0;
  pools_[pool][stream].emplace(size, ptr);
  pooled_ += static_cast<int64_t>(size);
}

void CachingAllocator::collect_pending(bool wait) {
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& b = pending_[i];
    auto done = std::remove_if(b.events.begin(), b.events.end(), [&](void* e) {
      if (wait) api_->synchronize_event(e);
      else if (!api_->event_done(e)) return false;
      api_->release_event(e);
      return true;
    });
    b.events.erase(done, b.events.end());
    if (b.events.empty()) {
      pending_bytes_ -= static_cast<int64_t>(b.size);
      to_pool(b.ptr, b.size, b.stream, b.pool);
    } else {
      if (kept != i) pending_[kept] = std::move(b);
      ++kept;
    }
  }
  pending_.resize(kept);
}

void* CachingAllocator::allocate(size_t nbytes) {
  const size_t rounded = round_size(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* stream = api_->current_stream();
  // Events recorded before a capture may be queried during it; none is recorded during one
  // (NOTE [graph pools]).
  if (!pending_.empty()) collect_pending(/*wait=*/false);
  void* p = take_cached(rounded, stream, capturing_);
  if (!p) {
    p = api_->malloc(rounded);
    // Out of memory: give the cache (pending blocks included) back and retry once; not while a
    // graph is captured, where freeing waits for the device, which a capture forbids.
    if (!p && capturing_ == 0) {
      release_cache();
      p = api_->malloc(rounded);
    }
    KILN_CHECK(p != nullptr, name_, " caching allocator: out of memory allocating ", nbytes, " bytes (",
               rounded, " rounded; ", current_, " bytes in use, ", reserved_,
               capturing_ != 0 ? " reserved; while a CUDA graph was captured, so the cache was kept)"
                               : " reserved after freeing the cache)");
    ++num_system_allocs_;
    reserved_ += static_cast<int64_t>(rounded);
    live_[p] = Block{rounded, 0, stream, capturing_, {}};
  }
  live_[p].requested = nbytes;
  current_ += static_cast<int64_t>(nbytes);
  peak_ = std::max(peak_, current_);
  ++num_allocs_;
  return p;
}

void CachingAllocator::deallocate(void* ptr, size_t nbytes) {
  (void)nbytes;  // the block knows what was asked for
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  KILN_CHECK(it != live_.end(), name_, " caching allocator: deallocate of a pointer it did not allocate");
  // Freed during a capture: the graph's (NOTE [graph pools]), unless another graph's pool that is
  // still open holds it (that graph writes it at its replays: it stays that graph's).
  const PoolId own = it->second.pool;
  const PoolId pool = capturing_ != 0 && !(own != 0 && pool_open(own)) ? capturing_ : own;
  Pending wait{ptr, it->second.size, it->second.stream, pool, {}};
  if (capturing_ != 0 && !it->second.uses.empty()) {  // not reused within the capture; no event
    current_ -= static_cast<int64_t>(it->second.requested);
    live_.erase(it);
    pending_bytes_ += static_cast<int64_t>(wait.size);
    capture_deferred_.push_back(std::move(wait));
    return;
  }
  try {
    for (void* s : it->second.uses) wait.events.push_back(api_->record_event(s));
  } catch (...) {  // the block stays live (and counted) rather than be reused too early
    for (void* e : wait.events) api_->release_event(e);
    throw;
  }
  current_ -= static_cast<int64_t>(it->second.requested);
  live_.erase(it);
  if (wait.events.empty()) {
    to_pool(ptr, wait.size, wait.stream, wait.pool);
  } else {
    pending_bytes_ += static_cast<int64_t>(wait.size);
    pending_.push_back(std::move(wait));
  }
}

void CachingAllocator::record_stream(void* ptr, const Stream& stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  KILN_CHECK(it != live_.end(), name_, " caching allocator: record_stream of memory it did not hand out (or freed)");
  void* s = stream.native();
  Block& b = it->second;
  if (s == b.stream || std::find(b.uses.begin(), b.uses.end(), s) != b.uses.end()) return;
  b.uses.push_back(s);
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

void CachingAllocator::free_pool(StreamPools& pools) {
  for (auto& [stream, pool] : pools) {
    while (!pool.empty()) {
      auto it = pool.begin();
      api_->free(it->second);
      reserved_ -= static_cast<int64_t>(it->first);
      pooled_ -= static_cast<int64_t>(it->first);
      pool.erase(it);
    }
  }
  pools.clear();
}

void CachingAllocator::release_cache() {
  if (!pending_.empty()) collect_pending(/*wait=*/true);
  auto own = pools_.find(0);  // the graph pools stay their graphs' (NOTE [graph pools])
  if (own != pools_.end()) free_pool(own->second);
}

void CachingAllocator::begin_allocate_to_pool(PoolId pool) {
  std::lock_guard<std::mutex> lock(mu_);
  KILN_CHECK(pool != 0, name_, " caching allocator: graph pool id 0 is the allocator's own");
  KILN_CHECK(capturing_ == 0, name_, " caching allocator: allocating to graph pool ", pool, " while pool ",
             capturing_, " is being allocated to (one capture at a time per device)");
  if (!pool_open(pool)) open_pools_.push_back(pool);
  capturing_ = pool;
}

void CachingAllocator::end_allocate_to_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Pending& b : capture_deferred_) {
    pending_bytes_ -= static_cast<int64_t>(b.size);
    to_pool(b.ptr, b.size, b.stream, b.pool);
  }
  capture_deferred_.clear();
  capturing_ = 0;
}

void CachingAllocator::release_pool(PoolId pool) {
  std::lock_guard<std::mutex> lock(mu_);
  KILN_CHECK(pool != 0 && pool != capturing_, name_, " caching allocator: release_pool(", pool,
             pool == 0 ? "): pool 0 is the allocator's own" : "): it is being allocated to");
  open_pools_.erase(std::remove(open_pools_.begin(), open_pools_.end(), pool), open_pools_.end());
  auto it = pools_.find(pool);
  if (it == pools_.end()) return;
  free_pool(it->second);
  pools_.erase(it);
}

int64_t CachingAllocator::pool_cached_bytes(PoolId pool) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  if (auto it = pools_.find(pool); it != pools_.end())
    for (const auto& [stream, blocks] : it->second)
      for (const auto& [size, ptr] : blocks) n += static_cast<int64_t>(size);
  for (const Pending& b : capture_deferred_)
    if (b.pool == pool) n += static_cast<int64_t>(b.size);
  return n;
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
  return pooled_ + pending_bytes_;
}

int64_t CachingAllocator::pending_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_bytes_;
}

}  // namespace kiln
