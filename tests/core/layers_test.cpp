// The layers of docs/design.md, checked on the sources: every `#include "kiln/<folder>/..."` in
// kiln/ names a folder of a lower layer or its own, so an arrow that runs up fails here (the
// message names the file, the line and both layers). One known exception, listed with its reason.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>

namespace {

namespace fs = std::filesystem;

// Bottom (0) to top; folders of one rank are siblings and may not include each other. The same
// table is drawn in docs/design.md ("Layers").
const std::map<std::string, int>& layer_of() {
  static const std::map<std::string, int> m = {
      {"core", 0},      {"autograd", 1}, {"kernels", 2},   {"io", 3},     {"telemetry", 4}, {"ops", 4},
      {"jit", 5},       {"data", 6},     {"dist", 6},      {"attention", 6}, {"loss", 6},
      {"nn", 7},        {"optim", 7},    {"parallel", 8},  {"train", 9},
  };
  return m;
}

// (including file, included folder): the backward engine sums gradients with ops' add, the one
// arrow that still runs up (autograd below ops, which record autograd nodes). Link order cannot
// express it either: the Tensor methods of core/tensor.h are defined in ops/ (copy, views), as
// ATen's are above c10's TensorImpl, so the layers are one library and this test is their check.
const std::set<std::pair<std::string, std::string>> kKnownExceptions = {{"kiln/autograd/engine.cpp", "ops"}};

std::string folder_of(const std::string& rel) {  // "kiln/kernels/cpu/x.h" -> "kernels"
  const size_t a = rel.find('/');
  const size_t b = rel.find('/', a + 1);
  return rel.substr(a + 1, b - a - 1);
}

TEST(Layers, EveryIncludeOfKilnRunsDownOrSideways) {
  const fs::path root = fs::path(KILN_SOURCE_DIR);
  const std::regex include_re(R"(^\s*#\s*include\s*"kiln/([a-z_]+)/)");
  int files = 0, includes = 0;
  std::set<std::string> unknown;
  for (const auto& e : fs::recursive_directory_iterator(root / "kiln")) {
    if (!e.is_regular_file()) continue;
    const std::string ext = e.path().extension().string();
    if (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh") continue;
    const std::string rel = fs::relative(e.path(), root).generic_string();
    const std::string from = folder_of(rel);
    auto lf = layer_of().find(from);
    if (lf == layer_of().end()) {
      unknown.insert(from);
      continue;
    }
    ++files;
    std::ifstream in(e.path());
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      std::smatch m;
      if (!std::regex_search(line, m, include_re)) continue;
      ++includes;
      const std::string to = m[1];
      auto lt = layer_of().find(to);
      if (lt == layer_of().end()) {
        ADD_FAILURE() << rel << ":" << n << " includes kiln/" << to << "/, a folder with no layer";
        continue;
      }
      if (to == from || lt->second < lf->second || kKnownExceptions.count({rel, to})) continue;
      ADD_FAILURE() << rel << ":" << n << ": " << from << " (layer " << lf->second << ") includes " << to
                    << " (layer " << lt->second << "): an arrow that runs " << (lt->second == lf->second ? "sideways" : "up");
    }
  }
  for (const auto& f : unknown) ADD_FAILURE() << "kiln/" << f << "/ has no layer: add it to this table and docs/design.md";
  EXPECT_GT(files, 150);  // the walk found the sources
  EXPECT_GT(includes, 400);
}

// The exceptions still exist (else they would hide a new arrow of the same pair).
TEST(Layers, KnownExceptionsAreStillThere) {
  for (const auto& [file, to] : kKnownExceptions) {
    std::ifstream in(fs::path(KILN_SOURCE_DIR) / file);
    ASSERT_TRUE(in.good()) << file;
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("#include \"kiln/" + to + "/"), std::string::npos)
        << file << " no longer includes kiln/" << to << "/: remove it from kKnownExceptions";
  }
}

}  // namespace
