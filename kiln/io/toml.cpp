// The TOML subset reader (see toml.h).
#include "kiln/io/toml.h"

#include <cctype>
#include <charconv>
#include <optional>
#include <stdexcept>

#include "kiln/core/error.h"

namespace kiln::io {

namespace {
// A TOML number without its '_' separators: a decimal integer (no leading zeros: "010" is not 8
// nor 10 in TOML), 0x / 0o / 0b integers, or a float (inf and nan included); nullopt when the
// text is none of these; an error when it is one but does not fit (int64, or double's range).
std::optional<json::Value> parse_toml_number(const std::string& num, const std::string& where) {
  if (num.empty()) return std::nullopt;
  const bool is_float = num.find_first_of(".eE") != std::string::npos || num.find("inf") != std::string::npos ||
                        num.find("nan") != std::string::npos;
  if (num.size() > 2 && num[0] == '0' && (num[1] == 'x' || num[1] == 'o' || num[1] == 'b')) {
    const int base = num[1] == 'x' ? 16 : num[1] == 'o' ? 8 : 2;
    int64_t v = 0;
    auto [p, ec] = std::from_chars(num.data() + 2, num.data() + num.size(), v, base);
    if (ec == std::errc::invalid_argument || p != num.data() + num.size()) return std::nullopt;
    KILN_CHECK(ec == std::errc(), where, ": integer '", num, "' does not fit in 64 bits");
    return json::Value(v);
  }
  if (is_float) {
    size_t used = 0;
    double d = 0;
    try {
      d = std::stod(num, &used);
    } catch (const std::out_of_range&) {
      fail(where, ": number '", num, "' is out of the range of a double");
    } catch (...) {
      return std::nullopt;
    }
    if (used != num.size()) return std::nullopt;
    return json::Value(d);
  }
  const size_t digits = num[0] == '+' || num[0] == '-' ? 1 : 0;
  if (num.size() == digits || num.find_first_not_of("0123456789", digits) != std::string::npos) return std::nullopt;
  KILN_CHECK(!(num.size() > digits + 1 && num[digits] == '0'), where, ": integer '", num,
             "' has a leading zero, which TOML does not allow (write it without, or 0x / 0o / 0b for other bases)");
  int64_t v = 0;
  auto [p, ec] = std::from_chars(num.data() + (num[0] == '+' ? 1 : 0), num.data() + num.size(), v);
  if (ec == std::errc::invalid_argument || p != num.data() + num.size()) return std::nullopt;
  KILN_CHECK(ec == std::errc(), where, ": integer '", num, "' does not fit in 64 bits");
  return json::Value(v);
}
}  // namespace

json::Value parse_toml(const std::string& text, const std::string& source) {
  json::Value root = json::Value::object();
  json::Value* table = &root;
  // A UTF-8 byte order mark (some editors write one) is not part of the first key.
  size_t line_no = 0, pos = text.rfind("\xEF\xBB\xBF", 0) == 0 ? 3 : 0;
  auto trim = [](std::string s) {
    size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
  };
  while (pos <= text.size()) {
    size_t nl = text.find('\n', pos);
    std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    pos = nl == std::string::npos ? text.size() + 1 : nl + 1;
    ++line_no;
    // strip comments outside strings
    bool in_s = false;
    char q = 0;
    for (size_t i = 0; i < line.size(); ++i) {
      char ch = line[i];
      if (in_s) {
        if (ch == '\\' && q == '"') ++i;
        else if (ch == q) in_s = false;
      } else if (ch == '"' || ch == '\'') {
        in_s = true;
        q = ch;
      } else if (ch == '#') {
        line.resize(i);
        break;
      }
    }
    line = trim(line);
    if (line.empty()) continue;
    auto where = [&]() { return source + ":" + std::to_string(line_no); };
    if (line.front() == '[') {
      KILN_CHECK(line.back() == ']' && line.size() > 2, where(), ": bad table header '", line, "'");
      std::string name = trim(line.substr(1, line.size() - 2));
      KILN_CHECK(!name.empty() && name.find_first_of("[]\"' ") == std::string::npos, where(), ": bad table name '",
                 name, "'");
      KILN_CHECK(!root.contains(name), where(), ": table [", name, "] defined twice");
      root[name] = json::Value::object();
      table = &root[name];
      continue;
    }
    size_t eq = line.find('=');
    KILN_CHECK(eq != std::string::npos, where(), ": expected 'key = value', got '", line, "'");
    std::string key = trim(line.substr(0, eq)), val = trim(line.substr(eq + 1));
    KILN_CHECK(!key.empty() && key.find_first_of(" \t\"'") == std::string::npos, where(), ": bad key '", key, "'");
    KILN_CHECK(!val.empty(), where(), ": missing value for '", key, "'");
    KILN_CHECK(!table->contains(key), where(), ": key '", key, "' defined twice");
    json::Value v;
    if (val.front() == '"') {
      KILN_CHECK(val.size() >= 2 && val.back() == '"', where(), ": unterminated string");
      try {
        v = json::parse(val);  // TOML basic strings use JSON's escapes
      } catch (const Error& e) {
        fail(where(), ": string value of '", key, "': ", e.what());
      }
    } else if (val.front() == '\'') {
      KILN_CHECK(val.size() >= 2 && val.back() == '\'', where(), ": unterminated string");
      v = val.substr(1, val.size() - 2);
    } else if (val == "true" || val == "false") {
      v = val == "true";
    } else {
      std::string num;
      for (size_t i = 0; i < val.size(); ++i) {
        if (val[i] != '_') {
          num.push_back(val[i]);
          continue;
        }
        // TOML allows '_' only between two digits (1_000, 0xff_ff); 1__0, 4_ and 1_e5 are not numbers.
        const bool hex = val.size() > 2 && val[0] == '0' && val[1] == 'x';
        auto digit = [&](char ch) {
          const auto u = static_cast<unsigned char>(ch);
          return hex ? std::isxdigit(u) != 0 : std::isdigit(u) != 0;
        };
        KILN_CHECK(i > 0 && i + 1 < val.size() && digit(val[i - 1]) && digit(val[i + 1]), where(), ": value '", val,
                   "': TOML allows '_' only between two digits");
      }
      std::optional<json::Value> n = parse_toml_number(num, where());
      KILN_CHECK(n.has_value(), where(), ": value '", val,
                 "' is not a string, number or boolean (kiln reads a TOML subset)");
      v = std::move(*n);
    }
    (*table)[key] = std::move(v);
  }
  return root;
}

}  // namespace kiln::io
