// ZIP central-directory reader (see zip.h). Every offset and length is checked against the
// archive's size before use.
#include "kiln/io/zip.h"

#include <algorithm>
#include <array>

#include "kiln/core/error.h"

namespace kiln::io {

namespace {

class Cursor {
 public:
  Cursor(std::string_view b, std::string_view what) : b_(b), what_(what) {}
  void check(uint64_t at, uint64_t n, const char* field) const {
    KILN_CHECK(at <= b_.size() && n <= b_.size() - at, what_, ": zip ", field, " at byte ", at,
               " runs past the end of the file (", b_.size(), " bytes)");
  }
  uint64_t le(uint64_t at, int n, const char* field) const {
    check(at, static_cast<uint64_t>(n), field);
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b_[at + static_cast<uint64_t>(i)]);
    return v;
  }
  std::string_view str(uint64_t at, uint64_t n, const char* field) const {
    check(at, n, field);
    return b_.substr(at, n);
  }
  uint64_t size() const { return b_.size(); }

 private:
  std::string_view b_;
  std::string_view what_;
};

constexpr uint32_t kEocd = 0x06054b50, kZip64Locator = 0x07064b50, kZip64Eocd = 0x06064b50,
                   kCentral = 0x02014b50, kLocal = 0x04034b50;

}  // namespace

std::vector<ZipEntry> read_zip_directory(std::string_view bytes, std::string_view what) {
  Cursor c(bytes, what);
  KILN_CHECK(c.size() >= 22, what, ": too short to be a zip archive");
  // End of central directory: the last 22..65557 bytes.
  uint64_t eocd = UINT64_MAX;
  const uint64_t lo = c.size() > 65557 ? c.size() - 65557 : 0;
  for (uint64_t at = c.size() - 22 + 1; at-- > lo;)
    if (c.le(at, 4, "end record") == kEocd) {
      eocd = at;
      break;
    }
  KILN_CHECK(eocd != UINT64_MAX, what, ": zip end-of-central-directory record not found (truncated file?)");
  uint64_t count = c.le(eocd + 10, 2, "entry count");
  uint64_t cd_size = c.le(eocd + 12, 4, "directory size");
  uint64_t cd_off = c.le(eocd + 16, 4, "directory offset");
  if ((count == 0xFFFF || cd_size == 0xFFFFFFFF || cd_off == 0xFFFFFFFF) && eocd >= 20 &&
      c.le(eocd - 20, 4, "zip64 locator") == kZip64Locator) {
    uint64_t z = c.le(eocd - 20 + 8, 8, "zip64 end offset");
    KILN_CHECK(c.le(z, 4, "zip64 end record") == kZip64Eocd, what, ": bad zip64 end-of-central-directory record");
    count = c.le(z + 32, 8, "zip64 entry count");
    cd_size = c.le(z + 40, 8, "zip64 directory size");
    cd_off = c.le(z + 48, 8, "zip64 directory offset");
  }
  c.check(cd_off, cd_size, "central directory");
  KILN_CHECK(count <= cd_size / 46, what, ": zip claims ", count, " entries in a directory of ", cd_size, " bytes");
  std::vector<ZipEntry> out;
  out.reserve(count);
  struct Span {
    uint64_t begin, end;  // [local header, end of the entry's data)
    size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(count);
  auto e_end = [](const ZipEntry& e) { return e.data_offset + e.compressed_size; };
  uint64_t at = cd_off;
  for (uint64_t k = 0; k < count; ++k) {
    KILN_CHECK(c.le(at, 4, "directory entry") == kCentral, what, ": zip directory entry ", k, " has a bad signature");
    ZipEntry e;
    e.method = static_cast<uint16_t>(c.le(at + 10, 2, "method"));
    e.crc32 = static_cast<uint32_t>(c.le(at + 16, 4, "crc-32"));
    e.compressed_size = c.le(at + 20, 4, "compressed size");
    e.size = c.le(at + 24, 4, "size");
    const uint64_t name_len = c.le(at + 28, 2, "name length"), extra_len = c.le(at + 30, 2, "extra length"),
                   comment_len = c.le(at + 32, 2, "comment length");
    uint64_t local = c.le(at + 42, 4, "local header offset");
    e.name = std::string(c.str(at + 46, name_len, "entry name"));
    // ZIP64 extra field: the 0xFFFFFFFF fields, in order size, compressed size, offset.
    uint64_t x = at + 46 + name_len;
    const uint64_t x_end = x + extra_len;
    c.check(x, extra_len, "extra field");
    while (x + 4 <= x_end) {
      const uint64_t id = c.le(x, 2, "extra id"), len = c.le(x + 2, 2, "extra length");
      KILN_CHECK(x + 4 + len <= x_end, what, ": zip entry '", e.name, "' has a malformed extra field");
      if (id == 0x0001) {
        uint64_t p = x + 4;
        auto take = [&](uint64_t& field) {
          if (field != 0xFFFFFFFF) return;
          KILN_CHECK(p + 8 <= x + 4 + len, what, ": zip entry '", e.name, "' has a short zip64 field");
          field = c.le(p, 8, "zip64 field");
          p += 8;
        };
        take(e.size);
        take(e.compressed_size);
        take(local);
      }
      x += 4 + len;
    }
    const uint64_t lname = c.le(local + 26, 2, "local name length"), lextra = c.le(local + 28, 2, "local extra length");
    KILN_CHECK(c.le(local, 4, "local header") == kLocal, what, ": zip entry '", e.name, "' has a bad local header");
    e.data_offset = local + 30 + lname + lextra;
    c.check(e.data_offset, e.compressed_size, "entry data");
    out.push_back(std::move(e));
    spans.push_back({local, e_end(out.back()), out.size() - 1});
    at += 46 + name_len + extra_len + comment_len;
  }
  // Each name once, and each entry's bytes (local header to the end of its data) its own: a
  // directory of 12,000 entries all pointing at one 20 MB member took 47 s to check, and a
  // duplicated name made which entry was read depend on the reader.
  std::vector<const ZipEntry*> by_name;
  by_name.reserve(out.size());
  for (const auto& e : out) by_name.push_back(&e);
  std::sort(by_name.begin(), by_name.end(), [](const ZipEntry* a, const ZipEntry* b) { return a->name < b->name; });
  for (size_t k = 1; k < by_name.size(); ++k)
    KILN_CHECK(by_name[k]->name != by_name[k - 1]->name, what, ": zip directory names the entry '", by_name[k]->name,
               "' more than once (a damaged or crafted archive)");
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < spans.size(); ++k)
    KILN_CHECK(spans[k].begin >= spans[k - 1].end, what, ": zip entries '", out[spans[k - 1].index].name, "' and '",
               out[spans[k].index].name, "' overlap in the file (bytes ", spans[k - 1].begin, "..", spans[k - 1].end,
               " and ", spans[k].begin, "..", spans[k].end, "): a damaged or crafted archive");
  return out;
}

uint32_t crc32(std::string_view bytes, uint32_t crc) {
  // Slicing by 8: table[k][b] is the CRC of byte b followed by k zero bytes (1.5 GB/s on one
  // core of the 2-core CI machine, 512 MB).
  static const auto tables = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b)
      for (size_t k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
    return t;
  }();
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t n = bytes.size();
  crc = ~crc;
  while (n >= 8) {
    const uint32_t lo = crc ^ (uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24);
    crc = tables[7][lo & 0xFF] ^ tables[6][(lo >> 8) & 0xFF] ^ tables[5][(lo >> 16) & 0xFF] ^ tables[4][lo >> 24] ^
          tables[3][p[4]] ^ tables[2][p[5]] ^ tables[1][p[6]] ^ tables[0][p[7]];
    p += 8, n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ tables[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

}  // namespace kiln::io
