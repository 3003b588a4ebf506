// Storage: a block of bytes on one device, owned through an allocator or borrowed from
// elsewhere (a memory-mapped file) with a keep-alive handle. Tensors share storages; the
// version counter lives here so every view of the bytes sees in-place writes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kiln/core/allocator.h"
#include "kiln/core/device.h"
#include "kiln/core/stream.h"

namespace kiln {

class Storage {
 public:
  // Allocates nbytes on `device` through its allocator.
  Storage(size_t nbytes, Device device);
  // Borrows `data` (not freed by kiln); `keepalive` holds whatever owns it.
  Storage(void* data, size_t nbytes, Device device, std::shared_ptr<void> keepalive);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  const Device& device() const { return device_; }
  bool borrowed() const { return allocator_ == nullptr; }
  // Sets every byte to `byte` through the allocator that owns the block (in order with the
  // device's later work); a borrowed storage is an error.
  void fill(uint8_t byte);
  // The bytes are also used by work queued on `stream` (a stream of this storage's device other
  // than the one current at allocation: a copy or communication stream). The allocator hands
  // them out again only after that work is done (NOTE [deferred frees] in
  // core/caching_allocator.h), as PyTorch's Tensor.record_stream. No-op for the CPU and for a
  // borrowed storage (its owner keeps it alive); a stream of another device is an error.
  void record_stream(const Stream& stream);

  uint64_t version() const { return version_; }
  void bump_version() { ++version_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  Allocator* allocator_ = nullptr;
  std::shared_ptr<void> keepalive_;
  uint64_t version_ = 0;
};

}  // namespace kiln
