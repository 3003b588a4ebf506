// Checkpoints written by PyTorch itself (tests/io/fixtures/, made by scripts/make_pt_fixtures.py
// on a machine with torch) load equal, bit for bit, to what torch saved: each X.pt (or .bin)
// against X.expected.safetensors written by the same script. Skips while the fixtures are absent.
#include <gtest/gtest.h>

#include <filesystem>

#include "kiln/io/load.h"
#include "tests/io/io_test_util.h"

namespace kiln::io {
namespace {

const std::string kFixtures = std::string(KILN_SOURCE_DIR) + "/tests/io/fixtures";

TEST(TorchFixtures, LoadEqualToWhatTorchSaved) {
  if (!std::filesystem::exists(kFixtures + "/dtypes.pt"))
    GTEST_SKIP() << "no PyTorch fixtures in " << kFixtures << " (run scripts/make_pt_fixtures.py where torch is installed)";
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kFixtures)) {
    const std::string ext = entry.path().extension().string();
    const std::string stem = entry.path().stem().string();
    if ((ext != ".pt" && ext != ".bin") || stem == "legacy") continue;
    const std::string path = entry.path().string();
    SCOPED_TRACE(path);
    EXPECT_EQ(sniff_format(path), FileFormat::torch_zip);
    TensorMap got = load(path);
    TensorMap want = load_safetensors(kFixtures + "/" + stem + ".expected.safetensors");
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_EQ(got[k].first, want[k].first);
      EXPECT_TRUE(same_bits(got[k].second, want[k].second, got[k].first));
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
}

TEST(TorchFixtures, LegacyFormatIsExplained) {
  const std::string path = kFixtures + "/legacy.pt";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no PyTorch fixtures in " << kFixtures;
  EXPECT_EQ(sniff_format(path), FileFormat::torch_legacy);
  try {
    load(path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("legacy PyTorch"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln::io
