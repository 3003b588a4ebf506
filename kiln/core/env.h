// Settings read from the environment (KILN_* knobs, RANK / WORLD_SIZE, SLURM's variables): an
// unset or empty variable gives the caller's fallback; a set one must parse completely and lie in
// range, else a kiln::Error names the variable, its value and what was expected. One parser, so
// that no setting is silently ignored when mistyped.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace kiln {

// The variable's value; nullopt when it is unset or empty.
std::optional<std::string> env_string(const char* name);
// A decimal integer in [lo, hi]; nullopt when unset or empty.
std::optional<int64_t> env_integer(const char* name, int64_t lo, int64_t hi);
inline int64_t env_integer(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  return env_integer(name, lo, hi).value_or(fallback);
}

}  // namespace kiln
