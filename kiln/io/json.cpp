// The strict JSON parser and the writer of json::Value.
#include "kiln/io/json.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "kiln/core/error.h"

namespace kiln::json {

namespace {
const char* kind_name(Value::Kind k) {
  switch (k) {
    case Value::Kind::null: return "null";
    case Value::Kind::boolean: return "a boolean";
    case Value::Kind::integer: return "an integer";
    case Value::Kind::number: return "a number";
    case Value::Kind::string: return "a string";
    case Value::Kind::array: return "an array";
    case Value::Kind::object: return "an object";
  }
  return "?";
}
}  // namespace

int utf8_lead_length(unsigned char b0) {
  return b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xE ? 3 : (b0 >> 3) == 0x1E ? 4 : 0;
}

size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  const int len = utf8_lead_length(b0);
  if (len == 0 || i + static_cast<size_t>(len) > s.size()) return 0;
  uint32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1Fu) : len == 3 ? (b0 & 0x0Fu) : (b0 & 0x07u);
  for (int k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3Fu);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;  // overlong, too large, surrogate
  return static_cast<size_t>(len);
}

size_t invalid_utf8_at(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

void check_utf8(std::string_view s, std::string_view what, std::string_view why) {
  const size_t bad = invalid_utf8_at(s);
  KILN_CHECK(bad == std::string_view::npos, what, " is not valid UTF-8 (byte ", bad, ")", why.empty() ? "" : ": ",
             why);
}

#define KILN_JSON_EXPECT(cond, kindword) \
  KILN_CHECK(cond, what, ": expected ", kindword, ", got ", kind_name(kind()))

bool Value::as_bool(std::string_view what) const { KILN_JSON_EXPECT(is_bool(), "a boolean"); return std::get<bool>(v_); }
int64_t Value::as_int(std::string_view what) const {
  if (kind() == Kind::number) {
    double d = std::get<double>(v_);
    KILN_CHECK(std::floor(d) == d && std::fabs(d) < 9.2e18, what, ": expected an integer, got ", d);
    return static_cast<int64_t>(d);
  }
  KILN_JSON_EXPECT(is_integer(), "an integer");
  return std::get<int64_t>(v_);
}
double Value::as_double(std::string_view what) const {
  if (is_integer()) return static_cast<double>(std::get<int64_t>(v_));
  KILN_JSON_EXPECT(kind() == Kind::number, "a number");
  return std::get<double>(v_);
}
const std::string& Value::as_string(std::string_view what) const { KILN_JSON_EXPECT(is_string(), "a string"); return std::get<std::string>(v_); }
const Value::Array& Value::as_array(std::string_view what) const { KILN_JSON_EXPECT(is_array(), "an array"); return std::get<Array>(v_); }
const Value::Object& Value::as_object(std::string_view what) const { KILN_JSON_EXPECT(is_object(), "an object"); return std::get<Object>(v_); }
Value::Array& Value::as_array(std::string_view what) { KILN_JSON_EXPECT(is_array(), "an array"); return std::get<Array>(v_); }
Value::Object& Value::as_object(std::string_view what) { KILN_JSON_EXPECT(is_object(), "an object"); return std::get<Object>(v_); }

Value& Value::operator[](std::string_view key) {
  if (is_null()) v_ = Object{};
  auto& o = as_object("operator[]");
  for (auto& [k, v] : o)
    if (k == key) return v;
  o.emplace_back(std::string(key), Value());
  return o.back().second;
}

const Value* Value::find(std::string_view key) const {
  if (!is_object()) return nullptr;
  for (const auto& [k, v] : std::get<Object>(v_))
    if (k == key) return &v;
  return nullptr;
}

void Value::push_back(Value v) {
  if (is_null()) v_ = Array{};
  as_array("push_back").push_back(std::move(v));
}

size_t Value::size() const {
  if (is_array()) return std::get<Array>(v_).size();
  if (is_object()) return std::get<Object>(v_).size();
  return 0;
}

std::string quote(std::string_view s) {
  // JSON text is UTF-8: raw bytes would make a file that no reader (kiln's included) accepts.
  check_utf8(s, "JSON: a string to write");
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
  return out;
}

void Value::dump_to(std::string& out, int indent, int level) const {
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * lvl), ' ');
  };
  switch (kind()) {
    case Kind::null: out += "null"; break;
    case Kind::boolean: out += std::get<bool>(v_) ? "true" : "false"; break;
    case Kind::integer: out += std::to_string(std::get<int64_t>(v_)); break;
    case Kind::number: {
      double d = std::get<double>(v_);
      if (!std::isfinite(d)) {
        out += "null";  // JSON has no NaN/Inf
      } else {
        char buf[32];
        auto [p, ec] = std::to_chars(buf, buf + sizeof buf, d);
        std::string s(buf, p);
        if (s.find_first_of(".eE") == std::string::npos) s += ".0";
        out += s;
      }
      break;
    }
    case Kind::string: out += quote(std::get<std::string>(v_)); break;
    case Kind::array: {
      const auto& a = std::get<Array>(v_);
      out += '[';
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += indent < 0 ? "," : ",";
        newline(level + 1);
        a[i].dump_to(out, indent, level + 1);
      }
      if (!a.empty()) newline(level);
      out += ']';
      break;
    }
    case Kind::object: {
      const auto& o = std::get<Object>(v_);
      out += '{';
      for (size_t i = 0; i < o.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        out += quote(o[i].first);
        out += indent < 0 ? ":" : ": ";
        o[i].second.dump_to(out, indent, level + 1);
      }
      if (!o.empty()) newline(level);
      out += '}';
      break;
    }
  }
}

std::string Value::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

namespace {

class Parser {
 public:
  Parser(std::string_view t, const ParseOptions& o) : s_(t), opt_(o) {}

  Value parse_document() {
    skip_ws();
    Value v = parse_value(0);
    skip_ws();
    if (i_ != s_.size()) error("unexpected trailing characters");
    return v;
  }

 private:
  [[noreturn]] void error(const std::string& msg) { fail("JSON: ", msg, " at byte ", i_); }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool consume(std::string_view lit) {
    if (s_.substr(i_, lit.size()) == lit) {
      i_ += lit.size();
      return true;
    }
    return false;
  }

  Value parse_value(int depth) {
    if (depth > opt_.max_depth) error("nesting deeper than " + std::to_string(opt_.max_depth));
    if (i_ >= s_.size()) error("unexpected end of input");
    char c = s_[i_];
    if (c == '{') return parse_object(depth);
    if (c == '[') return parse_array(depth);
    if (c == '"') return Value(parse_string());
    if (consume("true")) return Value(true);
    if (consume("false")) return Value(false);
    if (consume("null")) return Value();
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    error(std::string("unexpected character '") + c + "'");
  }

  Value parse_object(int depth) {
    ++i_;
    Value v = Value::object();
    auto& o = v.as_object();
    skip_ws();
    if (i_ < s_.size() && s_[i_] == '}') {
      ++i_;
      return v;
    }
    while (true) {
      skip_ws();
      if (i_ >= s_.size() || s_[i_] != '"') error("expected a string key");
      size_t key_at = i_;
      std::string key = parse_string();
      if (!opt_.allow_duplicate_keys)
        for (const auto& kv : o)
          if (kv.first == key) {
            i_ = key_at;
            error("duplicate key \"" + key + "\"");
          }
      skip_ws();
      if (i_ >= s_.size() || s_[i_] != ':') error("expected ':'");
      ++i_;
      skip_ws();
      Value item = parse_value(depth + 1);
      o.emplace_back(std::move(key), std::move(item));
      skip_ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == '}') {
        ++i_;
        return v;
      }
      error("expected ',' or '}'");
    }
  }

  Value parse_array(int depth) {
    ++i_;
    Value v = Value::array();
    skip_ws();
    if (i_ < s_.size() && s_[i_] == ']') {
      ++i_;
      return v;
    }
    while (true) {
      skip_ws();
      v.push_back(parse_value(depth + 1));
      skip_ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == ']') {
        ++i_;
        return v;
      }
      error("expected ',' or ']'");
    }
  }

  unsigned hex4() {
    if (i_ + 4 > s_.size()) error("truncated \\u escape");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = s_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
      else error("bad hex digit in \\u escape");
    }
    return v;
  }

  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) out += static_cast<char>(cp);
    else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  // Validates one UTF-8 sequence starting at i_ and appends it.
  void copy_utf8(std::string& out) {
    const size_t len = utf8_sequence_length(s_, i_);
    if (len == 0) error("invalid UTF-8");
    out.append(s_.substr(i_, len));
    i_ += len;
  }

  std::string parse_string() {
    ++i_;  // opening quote
    std::string out;
    while (true) {
      if (i_ >= s_.size()) error("unterminated string");
      char c = s_[i_];
      if (c == '"') {
        ++i_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) error("control character in string");
      if (c == '\\') {
        ++i_;
        if (i_ >= s_.size()) error("unterminated escape");
        char e = s_[i_++];
        switch (e) {
          case '"': out += '"'; break;
          case '\\': out += '\\'; break;
          case '/': out += '/'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'n': out += '\n'; break;
          case 'r': out += '\r'; break;
          case 't': out += '\t'; break;
          case 'u': {
            uint32_t cp = hex4();
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              if (!consume("\\u")) error("unpaired surrogate");
              uint32_t lo = hex4();
              if (lo < 0xDC00 || lo > 0xDFFF) error("unpaired surrogate");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
              error("unpaired surrogate");
            }
            put_utf8(out, cp);
            break;
          }
          default: error(std::string("bad escape '\\") + e + "'");
        }
        continue;
      }
      copy_utf8(out);
    }
  }

  Value parse_number() {
    size_t start = i_;
    bool integral = true;
    if (s_[i_] == '-') ++i_;
    if (i_ >= s_.size()) error("bad number");
    if (s_[i_] == '0') {
      ++i_;
    } else if (s_[i_] >= '1' && s_[i_] <= '9') {
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    } else {
      error("bad number");
    }
    if (i_ < s_.size() && s_[i_] == '.') {
      integral = false;
      ++i_;
      if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) error("bad number");
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      integral = false;
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) error("bad number");
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    std::string_view text = s_.substr(start, i_ - start);
    if (integral) {
      int64_t v = 0;
      auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec == std::errc() && p == text.data() + text.size()) return Value(v);
      // Too large for int64: keep as double.
    }
    double d = 0;
    auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
    if (p != text.data() + text.size()) error("bad number");
    // Out of a double's range (1e999, or 1e-999 below the smallest subnormal): an error, not the
    // 0 that from_chars leaves (a config's clip = 1e999 used to turn clipping off).
    if (ec == std::errc::result_out_of_range)
      error("number " + std::string(text) + " is out of the range of a double");
    return Value(d);
  }

  std::string_view s_;
  const ParseOptions& opt_;
  size_t i_ = 0;
};

}  // namespace

Value parse(std::string_view text, const ParseOptions& options) { return Parser(text, options).parse_document(); }

}  // namespace kiln::json
