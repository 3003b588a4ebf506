// The store's wire protocol (store_protocol.h): header checks, request decoding, encoders.
#include "kiln/dist/store_protocol.h"

#include <cstring>

#include "kiln/core/error.h"

namespace kiln::dist::proto {

const char* op_name(Op op) {
  switch (op) {
    case Op::auth: return "auth";
    case Op::set: return "set";
    case Op::get: return "get";
    case Op::add: return "add";
    case Op::compare_set: return "compare_set";
    case Op::wait: return "wait";
    case Op::check: return "check";
    case Op::delete_key: return "delete";
    case Op::num_keys: return "num_keys";
    case Op::ping: return "ping";
    case Op::nonce: return "nonce";
    case Op::ok: return "ok";
    case Op::not_found: return "not_found";
    case Op::timeout: return "timeout";
    case Op::error: return "error";
  }
  return "unknown";
}

namespace {
uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
bool known_op(uint8_t v) { return (v >= 1 && v <= 10) || (v >= 64 && v <= 68); }
}  // namespace

Header parse_header(const uint8_t* b) {
  const uint32_t magic = load_u32(b);
  KILN_CHECK(magic == kMagic, "store protocol: bad magic 0x", std::hex, magic, " (expected 0x", kMagic,
             "): not a kiln store peer");
  KILN_CHECK(b[4] == kVersion, "store protocol: version ", static_cast<int>(b[4]), " (this build speaks ",
             static_cast<int>(kVersion), ")");
  KILN_CHECK(known_op(b[5]), "store protocol: unknown op ", static_cast<int>(b[5]));
  KILN_CHECK(b[6] == 0 && b[7] == 0, "store protocol: flags must be 0");
  const uint32_t len = load_u32(b + 8);
  KILN_CHECK(len <= kMaxPayloadBytes, "store protocol: payload of ", len, " bytes exceeds the bound ",
             kMaxPayloadBytes);
  return {static_cast<Op>(b[5]), len};
}

uint32_t Reader::u32() {
  KILN_CHECK(remaining() >= 4, "store protocol: truncated payload (a 4-byte field at byte ", pos_, " of ",
             data_.size(), ")");
  const uint32_t v = load_u32(reinterpret_cast<const uint8_t*>(data_.data() + pos_));
  pos_ += 4;
  return v;
}

int64_t Reader::i64() {
  KILN_CHECK(remaining() >= 8, "store protocol: truncated payload (an 8-byte field at byte ", pos_, " of ",
             data_.size(), ")");
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | static_cast<uint8_t>(data_[pos_ + i]);
  pos_ += 8;
  return static_cast<int64_t>(v);
}

std::string Reader::string(size_t max_bytes, const char* what) {
  const uint32_t n = u32();
  KILN_CHECK(n <= max_bytes, "store protocol: ", what, " of ", n, " bytes exceeds the bound ", max_bytes);
  KILN_CHECK(remaining() >= n, "store protocol: truncated ", what, " (", n, " bytes announced, ", remaining(),
             " left)");
  std::string s(data_.substr(pos_, n));
  pos_ += n;
  return s;
}

void Reader::expect_end(const char* what) const {
  KILN_CHECK(remaining() == 0, "store protocol: ", remaining(), " trailing bytes after a ", what, " request");
}

Request parse_request(Op op, std::string_view payload) {
  Request r;
  r.op = op;
  Reader in(payload);
  switch (op) {
    case Op::auth: r.mac = in.string(kMacBytes, "mac"); break;
    case Op::set: r.key = in.string(kMaxKeyBytes, "key"); r.value = in.string(kMaxValueBytes, "value"); break;
    case Op::get: case Op::delete_key: r.key = in.string(kMaxKeyBytes, "key"); break;
    case Op::add: r.key = in.string(kMaxKeyBytes, "key"); r.number = in.i64(); break;
    case Op::compare_set:
      r.key = in.string(kMaxKeyBytes, "key");
      r.value = in.string(kMaxValueBytes, "expected value");
      r.desired = in.string(kMaxValueBytes, "desired value");
      break;
    case Op::wait: case Op::check: {
      const uint32_t n = in.u32();
      KILN_CHECK(n >= 1 && n <= kMaxKeys, "store protocol: ", op_name(op), " of ", n, " keys (expected 1 to ",
                 kMaxKeys, ")");
      r.keys.reserve(n);
      for (uint32_t i = 0; i < n; ++i) r.keys.push_back(in.string(kMaxKeyBytes, "key"));
      if (op == Op::wait) {
        r.number = in.i64();
        KILN_CHECK(r.number >= 0, "store protocol: wait timeout ", r.number, " ms is negative");
      }
      break;
    }
    case Op::num_keys: case Op::ping: break;
    default: fail("store protocol: op '", op_name(op), "' is not a request");
  }
  in.expect_end(op_name(op));
  return r;
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void put_i64(std::string& out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(u >> (8 * i)));
}
void put_string(std::string& out, std::string_view s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

void append_frame(std::string& out, Op op, std::string_view payload) {
  KILN_CHECK(payload.size() <= kMaxPayloadBytes, "store protocol: payload of ", payload.size(),
             " bytes exceeds the bound ", kMaxPayloadBytes);
  put_u32(out, kMagic);
  out.push_back(static_cast<char>(kVersion));
  out.push_back(static_cast<char>(op));
  out.push_back(0);
  out.push_back(0);
  put_u32(out, static_cast<uint32_t>(payload.size()));
  out.append(payload);
}

std::string encode_request(const Request& r) {
  std::string p;
  switch (r.op) {
    case Op::auth: put_string(p, r.mac); break;
    case Op::set: put_string(p, r.key); put_string(p, r.value); break;
    case Op::get: case Op::delete_key: put_string(p, r.key); break;
    case Op::add: put_string(p, r.key); put_i64(p, r.number); break;
    case Op::compare_set: put_string(p, r.key); put_string(p, r.value); put_string(p, r.desired); break;
    case Op::wait: case Op::check:
      put_u32(p, static_cast<uint32_t>(r.keys.size()));
      for (const auto& k : r.keys) put_string(p, k);
      if (r.op == Op::wait) put_i64(p, r.number);
      break;
    default: break;
  }
  std::string out;
  append_frame(out, r.op, p);
  return out;
}

std::optional<FrameParser::Frame> FrameParser::next() {
  if (buffered() < kHeaderBytes) return std::nullopt;
  const Header h = parse_header(reinterpret_cast<const uint8_t*>(buf_.data() + pos_));
  if (buffered() < kHeaderBytes + h.length) return std::nullopt;
  Frame f{h.op, buf_.substr(pos_ + kHeaderBytes, h.length)};
  pos_ += kHeaderBytes + h.length;
  if (pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
  } else if (pos_ > (1u << 16)) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  return f;
}

}  // namespace kiln::dist::proto
