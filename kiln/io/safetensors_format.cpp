// The safetensors dtype table and the strict header parser (see safetensors_format.h).
#include "kiln/io/safetensors_format.h"

#include <algorithm>
#include <limits>

#include "kiln/core/error.h"
#include "kiln/io/json.h"

namespace kiln::io {

const std::vector<FormatDType>& format_dtypes() {
  static const std::vector<FormatDType> kTable = {
      {"BOOL", 8, DType::boolean},   {"U8", 8, DType::u8},          {"I8", 8, DType::i8},
      {"F8_E5M2", 8, DType::f8_e5m2}, {"F8_E4M3", 8, DType::f8_e4m3}, {"F8_E8M0", 8, std::nullopt},
      {"F8_E4M3FNUZ", 8, std::nullopt}, {"F8_E5M2FNUZ", 8, std::nullopt},
      {"I16", 16, DType::i16},       {"U16", 16, std::nullopt},     {"F16", 16, DType::f16},
      {"BF16", 16, DType::bf16},     {"I32", 32, DType::i32},       {"U32", 32, std::nullopt},
      {"F32", 32, DType::f32},       {"F64", 64, DType::f64},       {"C64", 64, std::nullopt},
      {"I64", 64, DType::i64},       {"U64", 64, std::nullopt},     {"F4", 4, std::nullopt},
      {"F6_E2M3", 6, std::nullopt},  {"F6_E3M2", 6, std::nullopt},
  };
  return kTable;
}

const FormatDType* find_format_dtype(std::string_view name) {
  for (const auto& d : format_dtypes())
    if (name == d.name) return &d;
  return nullptr;
}

const char* format_dtype_name(DType t) {
  for (const auto& d : format_dtypes())
    if (d.kiln && *d.kiln == t) return d.name;
  fail("safetensors: kiln dtype ", dtype_name(t), " has no safetensors name");
}

uint64_t format_nbytes(const FormatDType& dt, uint64_t numel, std::string_view tensor, std::string_view file) {
  const uint64_t bits = static_cast<uint64_t>(dt.bits);
  KILN_CHECK(numel <= std::numeric_limits<uint64_t>::max() / bits, file, ": tensor '", tensor,
             "': size in bits overflows (rule: checked arithmetic)");
  const uint64_t total = numel * bits;
  KILN_CHECK(total % 8 == 0, file, ": tensor '", tensor, "': ", numel, " elements of ", dt.name, " are ",
             total, " bits, not a whole number of bytes (rule: total bits must be a multiple of 8)");
  return total / 8;
}

namespace {

// Reads a non-negative integer that fits in int64 from a JSON value.
uint64_t as_count(const json::Value& v, std::string_view file, std::string_view tensor, const char* field) {
  KILN_CHECK(v.is_integer(), file, ": tensor '", tensor, "': ", field,
             " must hold integers in [0, 2^63) (rule: integer fields)");
  int64_t x = v.as_int();
  KILN_CHECK(x >= 0, file, ": tensor '", tensor, "': ", field, " holds negative value ", x,
             " (rule: integer fields)");
  return static_cast<uint64_t>(x);
}

HeaderEntry parse_entry(const std::string& name, const json::Value& info, std::string_view file) {
  KILN_CHECK(info.is_object(), file, ": tensor '", name, "': entry is not a JSON object (rule: tensor entries)");
  HeaderEntry e;
  e.name = name;
  const json::Value *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
  for (const auto& [k, v] : info.as_object()) {
    if (k == "dtype") dtype = &v;
    else if (k == "shape") shape = &v;
    else if (k == "data_offsets") offsets = &v;
    else fail(file, ": tensor '", name, "': unknown field \"", k, "\" (rule: an entry has only dtype, shape, data_offsets)");
  }
  KILN_CHECK(dtype && shape && offsets, file, ": tensor '", name, "': missing field ",
             !dtype ? "dtype" : !shape ? "shape" : "data_offsets", " (rule: tensor entries)");
  KILN_CHECK(dtype->is_string(), file, ": tensor '", name, "': dtype is not a string (rule: dtype)");
  e.dtype = find_format_dtype(dtype->as_string());
  KILN_CHECK(e.dtype != nullptr, file, ": tensor '", name, "': unknown dtype \"", dtype->as_string(),
             "\" (rule: dtype is one of the format's 22)");
  KILN_CHECK(shape->is_array(), file, ": tensor '", name, "': shape is not an array (rule: shape)");
  uint64_t numel = 1;
  for (const auto& d : shape->as_array()) {
    uint64_t n = as_count(d, file, name, "shape");
    KILN_CHECK(n == 0 || numel <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / n, file,
               ": tensor '", name, "': shape product overflows (rule: checked arithmetic)");
    numel *= n;
    e.shape.push_back(static_cast<int64_t>(n));
  }
  e.numel = numel;
  KILN_CHECK(offsets->is_array() && offsets->size() == 2, file, ": tensor '", name,
             "': data_offsets must be an array [begin, end] (rule: data_offsets)");
  e.begin = as_count(offsets->as_array()[0], file, name, "data_offsets");
  e.end = as_count(offsets->as_array()[1], file, name, "data_offsets");
  KILN_CHECK(e.begin <= e.end, file, ": tensor '", name, "': data_offsets [", e.begin, ", ", e.end,
             "] end before begin (rule: data_offsets)");
  const uint64_t nbytes = format_nbytes(*e.dtype, numel, name, file);
  KILN_CHECK(e.end - e.begin == nbytes, file, ": tensor '", name, "': data_offsets [", e.begin, ", ", e.end,
             "] hold ", e.end - e.begin, " bytes but shape ", e.shape, " of ", e.dtype->name, " needs ", nbytes,
             " (rule: size matches shape x dtype)");
  return e;
}

}  // namespace

Header parse_safetensors_header(std::string_view text, uint64_t data_size, std::string_view file) {
  KILN_CHECK(!text.empty() && text[0] == '{', file, ": header does not start with '{' (rule: the header is a JSON object)");
  json::ParseOptions opt;
  opt.max_depth = kMaxHeaderNesting;
  opt.allow_duplicate_keys = true;  // found below in O(n log n), with the tensor named
  json::Value doc;
  try {
    doc = json::parse(text, opt);
  } catch (const Error& e) {
    fail(file, ": header is not valid JSON: ", e.what(), " (rule: UTF-8 JSON, bounded nesting)");
  }
  KILN_CHECK(doc.is_object(), file, ": header is not a JSON object (rule: the header is a JSON object)");
  Header h;
  bool seen_metadata = false;
  for (const auto& [name, info] : doc.as_object()) {
    if (name == "__metadata__") {
      KILN_CHECK(!seen_metadata, file, ": duplicate \"__metadata__\" (rule: unique names)");
      seen_metadata = true;
      KILN_CHECK(info.is_object(), file, ": __metadata__ is not an object (rule: metadata is a string to string map)");
      for (const auto& [k, v] : info.as_object()) {
        KILN_CHECK(v.is_string(), file, ": __metadata__ key \"", k,
                   "\" has a non-string value (rule: metadata is a string to string map)");
        KILN_CHECK(h.metadata.emplace(k, v.as_string()).second, file, ": __metadata__ key \"", k,
                   "\" appears twice (rule: unique names)");
      }
      continue;
    }
    h.tensors.push_back(parse_entry(name, info, file));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const HeaderEntry& a, const HeaderEntry& b) { return a.name < b.name; });
  for (size_t i = 1; i < h.tensors.size(); ++i)
    KILN_CHECK(h.tensors[i].name != h.tensors[i - 1].name, file, ": tensor '", h.tensors[i].name,
               "' appears twice (rule: unique names)");

  // Offsets, sorted: start at 0, no hole, no overlap, end at the data section's last byte.
  std::vector<const HeaderEntry*> order;
  order.reserve(h.tensors.size());
  for (const auto& e : h.tensors) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](const HeaderEntry* a, const HeaderEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t at = 0;
  for (const HeaderEntry* e : order) {
    KILN_CHECK(e->begin >= at, file, ": tensor '", e->name, "': data_offsets [", e->begin, ", ", e->end,
               "] overlap the previous tensor ending at ", at, " (rule: no overlap)");
    KILN_CHECK(e->begin == at, file, ": tensor '", e->name, "': data_offsets [", e->begin, ", ", e->end,
               "] leave a hole after byte ", at,
               at == 0 ? " (rule: offsets start at 0)" : " (rule: no hole between tensors)");
    at = e->end;
  }
  KILN_CHECK(at == data_size, file, ": tensors cover ", at, " bytes of data but the file holds ", data_size,
             " after the header (rule: data covers the file to its last byte)");
  return h;
}

Header parse_safetensors_file(std::string_view bytes, uint64_t* header_size, std::string_view file) {
  const uint64_t size = bytes.size();
  KILN_CHECK(size >= 8, file, ": file of ", size, " bytes is too short for a safetensors header (rule: 8-byte length)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  KILN_CHECK(n <= kMaxSafetensorsHeader, file, ": header length ", n, " exceeds the limit of ", kMaxSafetensorsHeader,
             " bytes (rule: header length)");
  KILN_CHECK(n <= size - 8, file, ": header length ", n, " exceeds the file's ", size - 8,
             " bytes after the length (rule: header length)");
  if (header_size) *header_size = n;
  return parse_safetensors_header(bytes.substr(8, n), size - 8 - n, file);
}

}  // namespace kiln::io
