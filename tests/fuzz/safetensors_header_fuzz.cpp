// libFuzzer target over the safetensors header parser: the input is a whole file's bytes
// (length prefix, header, data), parsed exactly as SafetensorsFile::open parses its mapping.
// Anything but a clean parse or a kiln::Error is a bug (crash, hang, sanitizer report).
// Built and run by scripts/fuzz (clang, -fsanitize=fuzzer,address) on tests/fuzz/corpus/.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kiln/core/error.h"
#include "kiln/io/safetensors_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    uint64_t n = 0;
    kiln::io::Header h = kiln::io::parse_safetensors_file(bytes, &n, "fuzz");
    // Invariants of an accepted header: offsets inside the data, sizes consistent.
    const uint64_t data_size = size - 8 - n;
    for (const auto& e : h.tensors)
      if (e.end > data_size || e.begin > e.end) __builtin_trap();
  } catch (const kiln::Error&) {
  }
  return 0;
}
