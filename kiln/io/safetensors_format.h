// The safetensors format itself, free of any I/O: its 22 dtypes (name, bits per element, the
// kiln DType when kiln can hold them) and the strict header parser. parse_safetensors_header
// is a pure function of the header bytes and the size of the data section, so the fuzzer
// (tests/fuzz/safetensors_header_fuzz.cpp) drives exactly what the reader runs.
// The rules it enforces are listed in docs/formats.md; each violation is a kiln::Error that
// names the tensor (when there is one) and the rule.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/core/dtype.h"

namespace kiln::io {

inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;  // bytes, as the reference reader
inline constexpr int kMaxHeaderNesting = 8;                     // JSON depth a valid header needs: 3

// One dtype of the format. `kiln` is empty for the dtypes kiln cannot hold as elements
// (U16, U32, U64, C64, F8_E8M0, F8_*FNUZ, F4, F6_*): those load as raw bytes.
struct FormatDType {
  const char* name;
  int bits;  // per element: 4 (F4), 6 (F6_*), 8, 16, 32, 64
  std::optional<DType> kiln;
};

// All 22 dtypes of the format.
const std::vector<FormatDType>& format_dtypes();
// The entry named `name` ("F32", "F4", ...), or nullptr.
const FormatDType* find_format_dtype(std::string_view name);
// The format's name of a kiln dtype (f32 → "F32").
const char* format_dtype_name(DType t);
// Bytes of `numel` elements of `dt`, or kiln::Error (naming `tensor`) on overflow or when the
// total number of bits is not a multiple of 8 (F4 / F6 tensors with an odd element count).
uint64_t format_nbytes(const FormatDType& dt, uint64_t numel, std::string_view tensor,
                       std::string_view file = "safetensors");
// The alignment the writer gives a dtype: its element size, at least 1.
inline uint64_t format_alignment(const FormatDType& dt) { return dt.bits >= 8 ? static_cast<uint64_t>(dt.bits / 8) : 1; }

// One tensor as the header describes it (offsets relative to the data section).
struct HeaderEntry {
  std::string name;
  const FormatDType* dtype = nullptr;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<HeaderEntry> tensors;   // sorted by name
  std::map<std::string, std::string> metadata;
};

// Parses and validates a header (the N bytes after the length prefix) for a data section of
// `data_size` bytes (file size − 8 − N). `file` names the file in errors.
Header parse_safetensors_header(std::string_view header, uint64_t data_size, std::string_view file = "safetensors");

// Checks the 8-byte length prefix of a whole file's bytes and parses the header that follows
// (what SafetensorsFile::open runs on the mapping). Sets *header_size to N.
Header parse_safetensors_file(std::string_view file_bytes, uint64_t* header_size, std::string_view file = "safetensors");

}  // namespace kiln::io
