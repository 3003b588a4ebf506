// safetensors reader (mmap + strict header) and writer (ordered, padded, streaming, atomic).
#include "kiln/io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "kiln/core/error.h"
#include "kiln/io/file.h"
#include "kiln/io/json.h"
#include "kiln/kernels/cpu/loops.h"

namespace kiln::io {

// ---- StoredTensor ----

bool StoredTensor::raw() const {
  const FormatDType* d = find_format_dtype(dtype);
  return d == nullptr || !d->kiln.has_value();
}

uint64_t StoredTensor::nbytes() const {
  const FormatDType* d = find_format_dtype(dtype);
  KILN_CHECK(d != nullptr, "safetensors: tensor '", name, "': unknown dtype \"", dtype, "\"");
  return format_nbytes(*d, static_cast<uint64_t>(shape_numel(shape)), name);
}

StoredTensor StoredTensor::from_tensor(std::string name, const Tensor& t) {
  KILN_CHECK(t.defined(), "safetensors: tensor '", name, "' is undefined");
  return StoredTensor{std::move(name), format_dtype_name(t.dtype()), t.shape(), t};
}

StoredTensor StoredTensor::from_raw(std::string name, std::string dtype, Shape shape, const Tensor& bytes) {
  StoredTensor s{std::move(name), std::move(dtype), std::move(shape), bytes};
  KILN_CHECK(find_format_dtype(s.dtype) != nullptr, "safetensors: tensor '", s.name, "': unknown dtype \"", s.dtype, "\"");
  KILN_CHECK(bytes.defined() && bytes.dtype() == DType::u8 && bytes.dim() == 1 &&
                 static_cast<uint64_t>(bytes.numel()) == s.nbytes(),
             "safetensors: raw tensor '", s.name, "' of ", s.dtype, " shape ", s.shape, " needs a 1-D u8 tensor of ",
             s.nbytes(), " bytes");
  return s;
}

TensorMap to_tensor_map(const StoredTensors& tensors, const std::string& where) {
  TensorMap out;
  out.reserve(tensors.size());
  for (const auto& s : tensors) {
    KILN_CHECK(!s.raw(), where, ": tensor '", s.name, "' has dtype ", s.dtype,
               ", which kiln cannot compute with; read it as raw bytes with SafetensorsFile or "
               "load_stored (see docs/formats.md)");
    out.emplace_back(s.name, s.data);
  }
  return out;
}

StoredTensors to_stored(const TensorMap& tensors) {
  StoredTensors out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) out.push_back(StoredTensor::from_tensor(name, t));
  return out;
}

// ---- reader ----

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.file_ = MappedFile::open(path);
  f.header_ = parse_safetensors_file(f.file_->bytes(0, f.file_->size()), &f.header_size_, path);
  return f;
}

uint64_t SafetensorsFile::file_bytes() const { return file_->size(); }

StoredTensor SafetensorsFile::tensor(const HeaderEntry& e) const {
  const uint64_t at = 8 + header_size_ + e.begin;
  StoredTensor s{e.name, e.dtype->name, e.shape, Tensor()};
  if (e.dtype->kiln)
    s.data = file_->view(at, e.shape, *e.dtype->kiln, file_);
  else
    s.data = file_->view(at, {static_cast<int64_t>(e.end - e.begin)}, DType::u8, file_);
  return s;
}

StoredTensors SafetensorsFile::tensors() const {
  StoredTensors out;
  out.reserve(header_.tensors.size());
  for (const auto& e : header_.tensors) out.push_back(tensor(e));
  return out;
}

TensorMap load_safetensors(const std::string& path, Metadata* metadata) {
  SafetensorsFile f = SafetensorsFile::open(path);
  if (metadata) *metadata = f.metadata();
  return to_tensor_map(f.tensors(), path);
}

void materialize(TensorMap& tensors) {
  constexpr int64_t kChunk = 1 << 20;  // bytes per parallel piece
  for (auto& [name, t] : tensors) {
    if (!t.defined() || !t.is_cpu() || !t.storage()->borrowed()) continue;
    Tensor src = t;
    if (!src.is_contiguous()) {
      t = is_storage_only(src.dtype()) ? Tensor::from_storage(src.storage(), src.shape(), src.strides(), src.offset(), DType::u8).contiguous() : src.contiguous();
      if (is_storage_only(src.dtype())) t = Tensor::from_storage(t.storage(), t.shape(), t.strides(), 0, src.dtype());
      continue;
    }
    Tensor dst = Tensor::empty(src.shape(), src.dtype());
    const int64_t n = static_cast<int64_t>(src.nbytes());
    const char* s = static_cast<const char*>(src.data_ptr());
    char* d = static_cast<char*>(dst.data_ptr());
    kernels::cpu::parallel_for((n + kChunk - 1) / kChunk, 1, [&](int64_t b, int64_t e) {
      const int64_t lo = b * kChunk, hi = std::min(n, e * kChunk);
      if (hi > lo) std::memcpy(d + lo, s + lo, static_cast<size_t>(hi - lo));
    });
    t = dst;
  }
}

// ---- writer ----

std::string safetensors_header_bytes(const StoredTensors& tensors, const Metadata& metadata,
                                     std::vector<size_t>* write_order) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::vector<const FormatDType*> dts;
  dts.reserve(tensors.size());
  for (const auto& s : tensors) {
    const FormatDType* d = find_format_dtype(s.dtype);
    KILN_CHECK(d != nullptr, "save_safetensors: tensor '", s.name, "': unknown dtype \"", s.dtype, "\"");
    KILN_CHECK(s.name != "__metadata__", "save_safetensors: a tensor may not be named \"__metadata__\"");
    // The header is JSON, which readers (kiln's, Python's) refuse with raw non-UTF-8 bytes.
    json::check_utf8(s.name, "save_safetensors: the name of tensor " + std::to_string(dts.size()));
    dts.push_back(d);
  }
  for (const auto& [k, v] : metadata) {
    json::check_utf8(k, "save_safetensors: a metadata key");
    json::check_utf8(v, "save_safetensors: metadata entry '" + k + "'");
  }
  // Descending alignment, then name: every tensor starts aligned to its element size.
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    uint64_t la = format_alignment(*dts[a]), lb = format_alignment(*dts[b]);
    return la != lb ? la > lb : tensors[a].name < tensors[b].name;
  });
  json::Value doc = json::Value::object();
  if (!metadata.empty()) {
    json::Value m = json::Value::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    doc["__metadata__"] = std::move(m);
  }
  uint64_t at = 0;
  auto& obj = doc.as_object();
  for (size_t i : order) {
    const StoredTensor& s = tensors[i];
    const uint64_t nb = s.nbytes();
    if (!s.raw()) {
      KILN_CHECK(s.data.defined() && format_dtype_name(s.data.dtype()) == s.dtype && s.data.shape() == s.shape,
                 "save_safetensors: tensor '", s.name, "' does not match its declared dtype/shape");
    } else {
      KILN_CHECK(s.data.defined() && s.data.dtype() == DType::u8 && static_cast<uint64_t>(s.data.numel()) == nb,
                 "save_safetensors: raw tensor '", s.name, "' needs ", nb, " bytes of u8 data");
    }
    json::Value e = json::Value::object();
    e["dtype"] = s.dtype;
    json::Value shape = json::Value::array();
    for (int64_t d : s.shape) shape.push_back(d);
    e["shape"] = std::move(shape);
    json::Value offs = json::Value::array();
    offs.push_back(at);
    offs.push_back(at + nb);
    e["data_offsets"] = std::move(offs);
    at += nb;
    obj.emplace_back(s.name, std::move(e));
  }
  {
    std::vector<std::string_view> names;
    names.reserve(tensors.size());
    for (const auto& s : tensors) names.push_back(s.name);
    std::sort(names.begin(), names.end());
    auto dup = std::adjacent_find(names.begin(), names.end());
    KILN_CHECK(dup == names.end(), "save_safetensors: tensor '", dup == names.end() ? "" : std::string(*dup),
               "' given twice");
  }
  std::string text = doc.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out += text;
  if (write_order) *write_order = std::move(order);
  return out;
}

void save_safetensors(const std::string& path, const StoredTensors& tensors, const Metadata& metadata) {
  std::vector<size_t> order;
  const std::string header = safetensors_header_bytes(tensors, metadata, &order);
  AtomicWriter w(path);
  w.write(header.data(), header.size());
  for (size_t i : order) w.write_tensor(tensors[i].data);  // one tensor (one host copy) at a time
  w.commit();
}

void save_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  save_safetensors(path, to_stored(tensors), metadata);
}

}  // namespace kiln::io
