// ArgParser implementation.
#include "cli/args.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "kiln/core/error.h"

namespace kiln::cli {

ArgParser::ArgParser(std::string command, std::string description)
    : command_(std::move(command)), description_(std::move(description)) {}

ArgParser& ArgParser::flag(const std::string& name, bool* out, const std::string& help) {
  Spec s;
  s.name = name;
  s.help = help;
  s.is_flag = true;
  s.set = [out](const std::string&) { *out = true; };
  specs_.push_back(std::move(s));
  return *this;
}

ArgParser& ArgParser::option(const std::string& name, std::string* out, const std::string& metavar,
                             const std::string& help) {
  Spec s{name, metavar, help, *out};
  s.set = [out](const std::string& v) { *out = v; };
  specs_.push_back(std::move(s));
  return *this;
}

ArgParser& ArgParser::option(const std::string& name, int64_t* out, const std::string& metavar,
                             const std::string& help) {
  Spec s{name, metavar, help, std::to_string(*out)};
  s.set = [out, name](const std::string& v) {
    size_t used = 0;
    long long x = 0;
    try {
      x = std::stoll(v, &used);
    } catch (...) {
      used = 0;
    }
    KILN_CHECK(used == v.size() && !v.empty(), name, ": expected an integer, got '", v, "'");
    *out = x;
  };
  specs_.push_back(std::move(s));
  return *this;
}

ArgParser& ArgParser::option(const std::string& name, double* out, const std::string& metavar,
                             const std::string& help) {
  std::ostringstream d;
  d << *out;
  Spec s{name, metavar, help, d.str()};
  s.set = [out, name](const std::string& v) {
    size_t used = 0;
    double x = 0;
    try {
      x = std::stod(v, &used);
    } catch (const std::out_of_range&) {
      // stod throws for subnormals too (1e-320 is one, and a double): strtod says which it is
      errno = 0;
      char* end = nullptr;
      x = std::strtod(v.c_str(), &end);
      used = static_cast<size_t>(end - v.c_str());
      KILN_CHECK(std::isfinite(x), name, ": '", v, "' is larger than a double can hold (at most 1.8e308)");
      KILN_CHECK(x != 0, name, ": '", v, "' is smaller than a double can hold (it rounds to 0; the smallest is 4.9e-324)");
    } catch (...) {
      used = 0;
    }
    KILN_CHECK(used == v.size() && !v.empty(), name, ": expected a number, got '", v, "'");
    *out = x;
  };
  specs_.push_back(std::move(s));
  return *this;
}

ArgParser& ArgParser::positional(const std::string& name, std::string* out, const std::string& help,
                                 bool required) {
  Spec s{name, name, help, ""};
  s.is_positional = true;
  s.required = required;
  s.set = [out](const std::string& v) { *out = v; };
  specs_.push_back(std::move(s));
  return *this;
}

ArgParser& ArgParser::without_default() {
  if (!specs_.empty()) specs_.back().default_text.clear();
  return *this;
}

ArgParser& ArgParser::epilog(const std::string& text) {
  epilog_ = text;
  return *this;
}

ArgParser::Spec* ArgParser::find(const std::string& name) {
  for (auto& s : specs_)
    if (!s.is_positional && s.name == name) return &s;
  return nullptr;
}

bool ArgParser::given(const std::string& name) const {
  for (const auto& s : specs_)
    if (s.name == name) return s.seen;
  return false;
}

bool ArgParser::parse(const std::vector<std::string>& args) {
  size_t next_positional = 0;
  auto positional_spec = [&]() -> Spec* {
    size_t k = 0;
    for (auto& s : specs_)
      if (s.is_positional && k++ == next_positional) return &s;
    return nullptr;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (a.size() > 2 && a.compare(0, 2, "--") == 0) {
      std::string name = a, value;
      bool has_value = false;
      if (auto eq = a.find('='); eq != std::string::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
        has_value = true;
      }
      Spec* s = find(name);
      KILN_CHECK(s != nullptr, "unknown option ", name, " (see 'kiln ", command_, " --help')");
      if (s->is_flag) {
        KILN_CHECK(!has_value, name, " takes no value");
      } else if (!has_value) {
        KILN_CHECK(i + 1 < args.size(), name, " needs a value (", s->metavar, ")");
        value = args[++i];
      }
      s->set(value);
      s->seen = true;
      continue;
    }
    Spec* p = positional_spec();
    KILN_CHECK(p != nullptr, "unexpected argument '", a, "' (see 'kiln ", command_, " --help')");
    p->set(a);
    p->seen = true;
    ++next_positional;
  }
  for (const auto& s : specs_)
    KILN_CHECK(!s.is_positional || !s.required || s.seen, "missing argument ", s.name,
               " (see 'kiln ", command_, " --help')");
  return true;
}

std::string ArgParser::help() const {
  std::ostringstream o;
  o << "usage: kiln " << command_;
  for (const auto& s : specs_)
    if (s.is_positional) o << (s.required ? " " : " [") << s.name << (s.required ? "" : "]");
  o << " [options]\n\n" << description_ << "\n";
  bool any_pos = false;
  for (const auto& s : specs_)
    if (s.is_positional) {
      if (!any_pos) o << "\narguments:\n";
      any_pos = true;
      o << "  " << s.name << "\n      " << s.help << "\n";
    }
  o << "\noptions:\n";
  for (const auto& s : specs_) {
    if (s.is_positional) continue;
    o << "  " << s.name;
    if (!s.is_flag) o << " " << s.metavar;
    o << "\n      " << s.help;
    if (!s.is_flag && !s.default_text.empty()) o << " (default: " << s.default_text << ")";
    o << "\n";
  }
  o << "  --help\n      show this help and exit\n";
  if (!epilog_.empty()) o << "\n" << epilog_ << "\n";
  return o.str();
}

int64_t parse_bytes(const std::string& text) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(text, &used);
  } catch (...) {
    fail("expected a size like 5GB or 512MiB, got '", text, "'");
  }
  std::string unit = text.substr(used);
  double mult = 1;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "KiB") mult = 1024.0;
  else if (unit == "MiB") mult = 1024.0 * 1024;
  else if (unit == "GiB") mult = 1024.0 * 1024 * 1024;
  else fail("unknown size unit '", unit, "' in '", text, "' (expected B, KB, MB, GB, KiB, MiB, GiB)");
  KILN_CHECK(x > 0, "size must be positive, got '", text, "'");
  KILN_CHECK(x * mult < 0x1p63, "size '", text, "' is too large (a size must be below 2^63 bytes)");
  return static_cast<int64_t>(x * mult);
}

}  // namespace kiln::cli
