// File plumbing shared by the readers and writers of kiln/io: a read-only memory mapping that
// tensors borrow (their Storage keeps the mapping alive), and an atomic, streaming file writer
// (temporary file in the destination's folder, fsync, rename, fsync of the folder).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kiln/core/tensor.h"

namespace kiln::io {

// A whole file mapped copy-on-write (MAP_PRIVATE): views may be written to without touching
// the file. Opening costs the same for 10 MB and 10 GB: nothing is read until touched.
class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  std::string_view bytes(uint64_t begin, uint64_t len) const;  // bounds-checked

  // A tensor viewing bytes [begin, begin + nbytes) of the file, contiguous with `shape`; the
  // storage keeps this mapping alive. Misaligned data (begin not a multiple of the element
  // size) is copied into an owned tensor instead.
  Tensor view(uint64_t begin, const Shape& shape, DType dtype, const std::shared_ptr<MappedFile>& self) const;

 private:
  MappedFile() = default;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  std::string path_;
};

// Writes a file atomically: everything goes to a temporary file next to `path`, which
// commit() fsyncs and renames over `path` (then fsyncs the folder). Destroyed without
// commit(), it removes the temporary file: a failed save never leaves a partial file. A `path`
// that exists and is not a regular file is refused; through a symlink, the file it names is
// replaced; the new file keeps the old one's mode, or takes 0666 less the umask.
class AtomicWriter {
 public:
  explicit AtomicWriter(std::string path);
  ~AtomicWriter();
  AtomicWriter(const AtomicWriter&) = delete;
  AtomicWriter& operator=(const AtomicWriter&) = delete;

  void write(const void* data, size_t n);
  // Writes a tensor's bytes in row-major order (one host copy at a time for CUDA or strided tensors).
  void write_tensor(const Tensor& t);
  uint64_t written() const { return written_; }
  void commit();

 private:
  std::string path_, target_, tmp_;  // as given (for messages), through symlinks, the temporary
  int fd_ = -1;
  uint64_t written_ = 0;
};

// Up to max_bytes of a regular file (index files, sniffing); kiln::Error when it cannot be read
// or is not a regular file (a pipe or a device is refused at once, never waited on; MappedFile too).
std::string read_file_prefix(const std::string& path, size_t max_bytes);
bool is_directory(const std::string& path);

}  // namespace kiln::io
