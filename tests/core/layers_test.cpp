// The layers of docs/design.md, checked on the sources: every `#include "kiln/<folder>/..."` in
// kiln/ names a folder of a lower layer or its own, so an arrow that runs up fails here (the
// message names the file, the line and both layers). The build checks the same table on the
// symbols (cmake/layers.cmake: each layer links alone against the ones below it).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <sstream>
#include <string>

namespace {

namespace fs = std::filesystem;

// Folder -> rank, from the one table of the layers: KILN_LAYER_RANKS in cmake/layers.cmake (the
// build's per-layer libraries and their link checks; docs/design.md draws it). Each entry is
// "RANK:folder,folder" on a line of its own inside set(KILN_LAYER_RANKS ...).
std::map<std::string, int> read_layer_table() {
  std::ifstream in(fs::path(KILN_SOURCE_DIR) / "cmake" / "layers.cmake");
  EXPECT_TRUE(in.good()) << "cmake/layers.cmake not found";
  std::map<std::string, int> m;
  const std::regex entry_re(R"re(^\s*"(\d+):([a-z_,]+)"\)?\s*$)re");
  bool inside = false;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("set(KILN_LAYER_RANKS") != std::string::npos) {
      inside = true;
      continue;
    }
    if (!inside) continue;
    std::smatch e;
    if (!std::regex_match(line, e, entry_re)) break;
    const int rank = std::stoi(e[1]);
    std::stringstream folders(e[2]);
    for (std::string f; std::getline(folders, f, ',');) m[f] = rank;
    if (line.find(')') != std::string::npos) break;
  }
  return m;
}

const std::map<std::string, int>& layer_of() {
  static const std::map<std::string, int> m = read_layer_table();
  return m;
}

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
      if (to == from || lt->second < lf->second) continue;
      ADD_FAILURE() << rel << ":" << n << ": " << from << " (layer " << lf->second << ") includes " << to
                    << " (layer " << lt->second << "): an arrow that runs " << (lt->second == lf->second ? "sideways" : "up");
    }
  }
  for (const auto& f : unknown) ADD_FAILURE() << "kiln/" << f << "/ has no layer: add it to this table and docs/design.md";
  EXPECT_GT(files, 150);  // the walk found the sources
  EXPECT_GT(includes, 400);
}

// The table has every layer of docs/design.md, bottom to top, and the drawing there matches it.
TEST(Layers, TableMatchesTheDesignDocument) {
  const auto& m = layer_of();
  ASSERT_GE(m.size(), 15u) << "cmake/layers.cmake's KILN_LAYER_RANKS was not read";
  EXPECT_EQ(m.at("core"), 0);
  EXPECT_LT(m.at("autograd"), m.at("ops"));
  EXPECT_LT(m.at("ops"), m.at("io"));  // io writes tensors through contiguous() and to()
  std::ifstream in(fs::path(KILN_SOURCE_DIR) / "docs" / "design.md");
  ASSERT_TRUE(in.good());
  // A row: the rank, then its folders ("6 kiln/attention/ loss/ data/ dist/"), then the text.
  const std::regex row_re(R"(^(\d) (kiln/[a-z_]+/(?: [a-z_]+/)*))");
  std::map<std::string, int> drawn;
  std::string line;
  while (std::getline(in, line)) {
    std::smatch r;
    if (!std::regex_search(line, r, row_re)) continue;
    std::stringstream folders(r[2].str());
    for (std::string f; folders >> f;) {
      if (f.rfind("kiln/", 0) == 0) f = f.substr(5);
      drawn[f.substr(0, f.size() - 1)] = std::stoi(r[1]);
    }
  }
  EXPECT_EQ(drawn.size(), m.size()) << "docs/design.md draws " << drawn.size() << " folders, cmake/layers.cmake has "
                                     << m.size();
  for (const auto& [folder, rank] : drawn) {
    auto it = m.find(folder);
    ASSERT_NE(it, m.end()) << "docs/design.md draws kiln/" << folder << "/, which cmake/layers.cmake lacks";
    EXPECT_EQ(it->second, rank) << "kiln/" << folder << "/: rank " << rank << " in docs/design.md, " << it->second
                                << " in cmake/layers.cmake";
  }
}

}  // namespace
