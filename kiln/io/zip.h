// A minimal, bounds-checked ZIP reader for PyTorch checkpoints: the central directory (ZIP64
// included), entry names, sizes, CRC-32s and the offset of each entry's data in the file. Only
// stored (uncompressed) entries can be read: torch.save writes nothing else.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::io {

struct ZipEntry {
  std::string name;
  uint16_t method = 0;           // 0 = stored
  uint64_t compressed_size = 0;
  uint64_t size = 0;
  uint64_t data_offset = 0;      // of the entry's bytes in the archive
  uint32_t crc32 = 0;            // of the entry's (uncompressed) bytes, from the central directory
};

// The ZIP (IEEE 802.3) CRC-32 of `bytes`, continuing from `crc` (0 to start).
uint32_t crc32(std::string_view bytes, uint32_t crc = 0);

// Lists the entries of the archive in `bytes` (the whole file); kiln::Error naming `what`
// and the problem on any malformed or out-of-bounds structure.
std::vector<ZipEntry> read_zip_directory(std::string_view bytes, std::string_view what);

}  // namespace kiln::io
