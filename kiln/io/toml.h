// parse_toml: the TOML subset kiln's config files use (`kiln train --config`, `kiln precompile
// --config`): comments (#), [table] headers, `key = value` with basic ("...") and literal ('...')
// strings, integers (decimal without leading zeros, 0x / 0o / 0b, '_' between digits), floats
// (inf and nan included) and booleans. No arrays, inline tables, dotted keys or dates: those are
// errors naming the line. The result is a JSON object, each [table] a nested object.
#pragma once
#include <string>

#include "kiln/io/json.h"

namespace kiln::io {

// Errors are kiln::Error naming `source:line` and what was wrong.
json::Value parse_toml(const std::string& text, const std::string& source = "config");

}  // namespace kiln::io
