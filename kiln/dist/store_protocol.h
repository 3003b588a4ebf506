// The store's wire protocol: length-prefixed binary frames with a magic and a version, the
// request and response types, and an incremental parser that a server feeds with whatever
// bytes arrive. Every bound is checked before anything is allocated: a malformed, oversized
// or truncated frame is a kiln::Error, never a crash or an unbounded allocation.
//
// Frame: u32 magic 'KLNS' | u8 version | u8 op | u16 flags (0) | u32 payload length | payload.
// Payload fields: strings as u32 length + bytes, integers as 8 little-endian bytes, lists as
// a u32 count followed by their items. See docs/distributed.md ("The store").
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::dist::proto {

inline constexpr uint32_t kMagic = 0x534E4C4Bu;  // "KLNS" read as little-endian bytes
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 12;
inline constexpr size_t kMaxKeyBytes = 4096;
inline constexpr size_t kMaxValueBytes = 16u << 20;
inline constexpr size_t kMaxKeys = 4096;  // keys of one wait / check
inline constexpr size_t kMaxPayloadBytes = kMaxValueBytes * 2 + 2 * kMaxKeyBytes + 64;
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;

enum class Op : uint8_t {
  // client -> server
  auth = 1, set = 2, get = 3, add = 4, compare_set = 5, wait = 6, check = 7, delete_key = 8,
  num_keys = 9, ping = 10,
  // server -> client
  nonce = 64, ok = 65, not_found = 66, timeout = 67, error = 68,
};
const char* op_name(Op op);

struct Header {
  Op op;
  uint32_t length;
};

// A decoded request. Which fields are used depends on op.
struct Request {
  Op op{};
  std::string key;
  std::string value;       // set: value; compare_set: expected
  std::string desired;     // compare_set
  int64_t number = 0;      // add: delta; wait: timeout in ms
  std::vector<std::string> keys;  // wait, check
  std::string mac;         // auth
};

// Header of a frame; throws on a wrong magic, version, op, flags or a length over the bound.
Header parse_header(const uint8_t* bytes);
// Decodes a client request's payload; throws on anything malformed (truncated fields,
// trailing bytes, sizes over the bounds, an op a client may not send).
Request parse_request(Op op, std::string_view payload);

// Encoders (append one whole frame to `out`).
void append_frame(std::string& out, Op op, std::string_view payload);
void put_u32(std::string& out, uint32_t v);
void put_i64(std::string& out, int64_t v);
void put_string(std::string& out, std::string_view s);
std::string encode_request(const Request& r);

// Reads fields of a payload in order, throwing when one runs past the end.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  uint32_t u32();
  int64_t i64();
  std::string string(size_t max_bytes, const char* what);
  size_t remaining() const { return data_.size() - pos_; }
  void expect_end(const char* what) const;

 private:
  std::string_view data_;
  size_t pos_ = 0;
};

// Reassembles frames from a byte stream: feed() whatever arrived, then next() until empty.
// Bytes are buffered only up to one frame (header + the payload it announces, bounded).
class FrameParser {
 public:
  struct Frame {
    Op op;
    std::string payload;
  };
  void feed(const char* data, size_t n) { buf_.append(data, n); }
  // The next whole frame, or nullopt when more bytes are needed; throws on a bad header.
  std::optional<Frame> next();
  size_t buffered() const { return buf_.size() - pos_; }

 private:
  std::string buf_;
  size_t pos_ = 0;
};

}  // namespace kiln::dist::proto
