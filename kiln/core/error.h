// kiln::Error, the one exception type kiln throws, and KILN_CHECK, which builds its message
// from any streamable pieces: KILN_CHECK(i < n, "embedding: index[", k, "]=", i, " out of range").
#pragma once
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace kiln {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void append(std::ostringstream& s, const std::vector<int64_t>& v) {
  s << '[';
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << ']';
}
template <class T>
void append(std::ostringstream& s, const T& v) { s << v; }
template <class... A>
std::string str_cat(const A&... a) {
  std::ostringstream s;
  (append(s, a), ...);
  return s.str();
}
}  // namespace detail

template <class... A>
[[noreturn]] void fail(const A&... a) { throw Error(detail::str_cat(a...)); }

}  // namespace kiln

#define KILN_CHECK(cond, ...)                          \
  do {                                                 \
    if (!(cond)) ::kiln::fail(__VA_ARGS__);            \
  } while (0)
