// The default training corpus: the project's README, docs and headers, embedded into the
// library at build time by cmake/embed.cmake (what `kiln train` with no --data learns from).
#pragma once
#include <string_view>

namespace kiln::data {

std::string_view default_corpus();

}  // namespace kiln::data
