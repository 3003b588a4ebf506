// Settings read from the environment: one parser with errors that name the variable.
#include "kiln/core/env.h"

#include <cerrno>
#include <cstdlib>

#include "kiln/core/error.h"

namespace kiln {

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<int64_t> env_integer(const char* name, int64_t lo, int64_t hi) {
  const std::optional<std::string> v = env_string(name);
  if (!v) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  KILN_CHECK(end != v->c_str() && *end == '\0' && errno == 0 && n >= lo && n <= hi, name, "='", *v,
             "': expected an integer in [", lo, ", ", hi, "]");
  return static_cast<int64_t>(n);
}

}  // namespace kiln
