// json::Value: kiln's JSON document type, with a strict parser (UTF-8 checked, nesting
// bounded, duplicate keys refused, numbers kept exactly as integers when they are) and a
// writer. Objects keep insertion order, so what kiln writes is stable and diffable.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace kiln::json {

class Value {
 public:
  enum class Kind { null, boolean, integer, number, string, array, object };
  using Object = std::vector<std::pair<std::string, Value>>;
  using Array = std::vector<Value>;

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v_(b) {}
  Value(int v) : v_(static_cast<int64_t>(v)) {}
  Value(int64_t v) : v_(v) {}
  Value(uint64_t v) : v_(static_cast<int64_t>(v)) {}
  Value(double v) : v_(v) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(std::string_view s) : v_(std::string(s)) {}
  static Value array() { Value v; v.v_ = Array{}; return v; }
  static Value object() { Value v; v.v_ = Object{}; return v; }

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  bool is_null() const { return kind() == Kind::null; }
  bool is_bool() const { return kind() == Kind::boolean; }
  bool is_integer() const { return kind() == Kind::integer; }
  bool is_number() const { return kind() == Kind::integer || kind() == Kind::number; }
  bool is_string() const { return kind() == Kind::string; }
  bool is_array() const { return kind() == Kind::array; }
  bool is_object() const { return kind() == Kind::object; }

  // Accessors throw kiln::Error naming `what` when the kind differs.
  bool as_bool(std::string_view what = "value") const;
  int64_t as_int(std::string_view what = "value") const;
  double as_double(std::string_view what = "value") const;
  const std::string& as_string(std::string_view what = "value") const;
  const Array& as_array(std::string_view what = "value") const;
  const Object& as_object(std::string_view what = "value") const;
  Array& as_array(std::string_view what = "value");
  Object& as_object(std::string_view what = "value");

  // Object access: operator[] inserts (turning null into an object); find returns null if absent.
  Value& operator[](std::string_view key);
  const Value* find(std::string_view key) const;
  bool contains(std::string_view key) const { return find(key) != nullptr; }
  void push_back(Value v);
  size_t size() const;

  // Compact one-line JSON (indent < 0) or pretty-printed with `indent` spaces.
  std::string dump(int indent = -1) const;

 private:
  void dump_to(std::string& out, int indent, int level) const;
  std::variant<std::monostate, bool, int64_t, double, std::string, Array, Object> v_;
};

struct ParseOptions {
  int max_depth = 64;
  bool allow_duplicate_keys = false;
};

// Parses exactly one JSON value (surrounding whitespace allowed). Throws kiln::Error with the
// byte offset and what was wrong.
Value parse(std::string_view text, const ParseOptions& options = {});

// Escapes a string as a JSON string literal (with the quotes); a string that is not valid UTF-8
// is a kiln::Error (no reader would take the file).
std::string quote(std::string_view s);
// The length (1 to 4) a UTF-8 sequence starting with byte b0 has; 0 for a continuation byte or
// one that starts none.
int utf8_lead_length(unsigned char b0);
// The bytes of the valid UTF-8 sequence at s[i] (1 to 4), 0 when none starts there (overlong
// forms, surrogates and code points past U+10FFFF are invalid).
size_t utf8_sequence_length(std::string_view s, size_t i);
// The offset of the first byte that is not valid UTF-8, npos when the whole string is.
size_t invalid_utf8_at(std::string_view s);
// kiln::Error "<what> is not valid UTF-8 (byte N)[: <why>]" unless s is valid UTF-8.
void check_utf8(std::string_view s, std::string_view what, std::string_view why = {});

}  // namespace kiln::json
