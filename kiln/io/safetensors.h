// Native safetensors: a strict, zero-copy reader (tensors are views of a memory mapping) and
// a streaming, atomic writer. docs/formats.md lists the rules the reader enforces.
//
// Raw dtypes: the format has dtypes kiln cannot compute with (U16, U32, U64, C64, F8_E8M0,
// F8_E4M3FNUZ, F8_E5M2FNUZ, F4, F6_E2M3, F6_E3M2). A StoredTensor carries the format's dtype
// name and shape with, for those, the raw bytes as a 1-D u8 tensor; `kiln inspect` shows them
// and `kiln convert` and save_safetensors(…, StoredTensors) copy them through unchanged.
// load_safetensors (name → Tensor) refuses them with an error that names the tensor.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/io/safetensors_format.h"

namespace kiln::io {

using TensorMap = std::vector<std::pair<std::string, Tensor>>;  // ordered by name as stored
using Metadata = std::map<std::string, std::string>;

// One tensor of a file, whatever its dtype.
struct StoredTensor {
  std::string name;
  std::string dtype;  // the format's name: "F32", "BF16", "F4", ...
  Shape shape;
  // For kiln dtypes: the tensor itself (a view of the mapping when read). For raw dtypes:
  // a 1-D u8 tensor of the bytes (shape product × bits / 8 of them).
  Tensor data;
  bool raw() const;
  uint64_t nbytes() const;  // bytes in the file
  static StoredTensor from_tensor(std::string name, const Tensor& t);
  // A raw tensor: `bytes` is a u8 tensor of exactly the bytes dtype × shape needs.
  static StoredTensor from_raw(std::string name, std::string dtype, Shape shape, const Tensor& bytes);
};
using StoredTensors = std::vector<StoredTensor>;

// An opened safetensors file: the header parsed and checked, the data mapped (not read).
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  const std::string& path() const { return path_; }
  const Metadata& metadata() const { return header_.metadata; }
  const std::vector<HeaderEntry>& entries() const { return header_.tensors; }  // sorted by name
  uint64_t header_bytes() const { return header_size_; }
  uint64_t file_bytes() const;
  // The tensor of one entry (a view of the mapping; raw dtypes give their bytes).
  StoredTensor tensor(const HeaderEntry& e) const;
  StoredTensors tensors() const;

 private:
  std::string path_;
  std::shared_ptr<class MappedFile> file_;
  Header header_;
  uint64_t header_size_ = 0;
};

void save_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata = {});
// Same, for tensors of any format dtype (raw ones included).
void save_safetensors(const std::string& path, const StoredTensors& tensors, const Metadata& metadata = {});
TensorMap load_safetensors(const std::string& path, Metadata* metadata = nullptr);  // zero-copy views of an mmap

// Replaces every tensor that borrows a file mapping with an owned, contiguous copy (parallel
// copies), so the file can be closed, deleted or rewritten; owned tensors are left as they are.
void materialize(TensorMap& tensors);

// The ordered, padded header bytes (length prefix included) that save_safetensors writes for
// these tensors, and each tensor's position in the data section (same order as `tensors`).
std::string safetensors_header_bytes(const StoredTensors& tensors, const Metadata& metadata,
                                     std::vector<size_t>* write_order = nullptr);

// Name → Tensor for kiln dtypes; raw dtypes give a kiln::Error naming the tensor.
TensorMap to_tensor_map(const StoredTensors& tensors, const std::string& where);
StoredTensors to_stored(const TensorMap& tensors);

}  // namespace kiln::io
