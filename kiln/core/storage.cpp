// Storage allocation, filling, stream uses and release through the device's allocator.
#include "kiln/core/storage.h"

#include "kiln/core/error.h"

namespace kiln {

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  allocator_ = &allocator_for(device);
  data_ = allocator_->allocate(nbytes);
}

Storage::Storage(void* data, size_t nbytes, Device device, std::shared_ptr<void> keepalive)
    : data_(data), nbytes_(nbytes), device_(device), keepalive_(std::move(keepalive)) {}

void Storage::fill(uint8_t byte) {
  KILN_CHECK(allocator_ != nullptr, "Storage::fill: the storage is borrowed, not owned by an allocator");
  allocator_->fill(data_, nbytes_, byte);
}

void Storage::record_stream(const Stream& stream) {
  KILN_CHECK(stream.device() == device_, "Storage::record_stream: the storage is on ", device_.str(),
             ", the stream on ", stream.device().str());
  if (allocator_ && !stream.is_cpu()) allocator_->record_stream(data_, stream);
}

Storage::~Storage() {
  if (allocator_) allocator_->deallocate(data_, nbytes_);
}

}  // namespace kiln
