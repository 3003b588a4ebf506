// Helpers for the io tests: a temporary folder, random tensors of any dtype (random bytes for
// the storage-only ones), a tensor's bytes, raw file writing; bitwise comparison is
// tests/expect.h's same_bits.
#pragma once
#include <cstdint>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "kiln/core/rng.h"
#include "kiln/core/tensor.h"
#include "kiln/ops/ops.h"
#include "tests/expect.h"

namespace kiln::io {

using kiln::test::same_bits;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kiln_io_XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    if (!p) throw std::runtime_error("mkdtemp failed");
    path_ = p;
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A contiguous tensor of `dtype` filled with random bits that are valid for the dtype
// (bool 0/1; floats from randn; the rest random bytes).
inline Tensor random_bytes_tensor(const Shape& shape, DType dtype, Generator& gen) {
  if (is_floating(dtype)) return randn(shape, gen, dtype);
  Tensor r = rand(shape, gen, DType::f64);
  std::vector<double> v = r.to_vector<double>();
  Tensor t = Tensor::empty(shape, dtype);
  auto* b = static_cast<uint8_t*>(t.data_ptr());
  const size_t isz = itemsize(dtype);
  for (size_t i = 0; i < v.size(); ++i) {
    uint64_t bits = static_cast<uint64_t>(v[i] * 18446744073709551615.0);
    if (dtype == DType::boolean) bits &= 1;
    std::memcpy(b + i * isz, &bits, isz);
  }
  return t;
}

inline std::vector<uint8_t> tensor_bytes(const Tensor& t) {
  Tensor c = t;
  if (!c.is_contiguous()) c = is_storage_only(c.dtype()) ? Tensor::from_storage(c.storage(), c.shape(), c.strides(), c.offset(), DType::u8).contiguous() : c.contiguous();
  std::vector<uint8_t> out(c.nbytes());
  if (!out.empty()) std::memcpy(out.data(), c.data_ptr(), out.size());
  return out;
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace kiln::io
