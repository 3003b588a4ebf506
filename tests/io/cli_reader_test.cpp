// The readers through the kiln program: inspect shows names from the file escaped (a crafted
// name sent terminal escape sequences through the table), and convert round-trips a
// safetensors file with no tensors (Python's safetensors writes and reads one; convert refused it).
#include <gtest/gtest.h>

#include <string>

#include "kiln/io/load.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"
#include "tests/cli_run.h"
#include "tests/io/io_test_util.h"

namespace kiln::io {
namespace {

using test::CliOutcome;
using test::run_kiln;

TEST(ReaderCli, InspectEscapesControlCharactersInNames) {
  TempDir dir;
  const std::string name = "evil\x1b]0;pwned\x07\x1b[2Jname";
  save_safetensors(dir.file("e.safetensors"), {{name, from_vector(std::vector<float>{1, 2}, {2})}},
                   {{"note\x1b[31m", "red\x1b[0m"}});
  const CliOutcome r = run_kiln("inspect " + dir.file("e.safetensors"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find('\x1b'), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\x07'), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("evil\\x1b]0;pwned\\x07\\x1b[2Jname"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("metadata note\\x1b[31m = red\\x1b[0m"), std::string::npos) << r.output;
}

TEST(ReaderCli, ConvertRoundTripsASafetensorsFileWithNoTensors) {
  TempDir dir;
  save_safetensors(dir.file("empty.safetensors"), TensorMap{}, Metadata{{"format", "pt"}});
  const CliOutcome r = run_kiln("convert " + dir.file("empty.safetensors") + " " + dir.file("out.safetensors"));
  ASSERT_EQ(r.status, 0) << r.output;
  Metadata md;
  EXPECT_TRUE(load_stored(dir.file("out.safetensors"), &md).empty());
  EXPECT_EQ(md.at("format"), "pt");
}

}  // namespace
}  // namespace kiln::io
