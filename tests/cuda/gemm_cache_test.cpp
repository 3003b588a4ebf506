// The GEMM backend selection's plain parts, which run without a GPU: the on-disk choice cache
// (kernels/cuda/gemm/autotune_cache.h: entries of another GPU, driver or kiln version ignored, a
// corrupt file ignored with a warning and replaced), backend and epilogue names, and
// KILN_GEMM_BACKEND.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/kernels/cuda/gemm/autotune_cache.h"
#include "kiln/kernels/cuda/gemm/gemm.h"

using namespace kiln::kernels::gemm;

namespace {

std::string temp_dir(const char* tag) {
  std::string d = std::filesystem::temp_directory_path().string() + "/kiln_gemm_cache_" + tag + "_" +
                  std::to_string(::getpid());
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}
std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
const MachineKey kH200{"NVIDIA H200 sm_90 132SM", "13000", "0.1.0"};

}  // namespace

TEST(GemmCache, StoresAndFindsItsOwnMachinesChoices) {
  const std::string dir = temp_dir("own"), path = dir + "/sub/gemm_choices.tsv";
  {
    ChoiceCache c(path, kH200);
    EXPECT_FALSE(c.lookup("8192x8192x8192*1|nt|bf16>bf16|none").has_value());
    c.store("8192x8192x8192*1|nt|bf16>bf16|none", {true, 1.25, 1.5});
    c.store("7x129x1000*1|nn|f16>f32|bias", {false, 0.5, 0.25});
  }
  ChoiceCache again(path, kH200);  // a new process reads the file
  EXPECT_FALSE(again.ignored_corrupt_file());
  auto a = again.lookup("8192x8192x8192*1|nt|bf16>bf16|none");
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->kiln);
  EXPECT_DOUBLE_EQ(a->kiln_ms, 1.25);
  EXPECT_DOUBLE_EQ(a->cublaslt_ms, 1.5);
  auto b = again.lookup("7x129x1000*1|nn|f16>f32|bias");
  ASSERT_TRUE(b.has_value());
  EXPECT_FALSE(b->kiln);
  EXPECT_FALSE(again.lookup("7x129x1000*1|nn|f16>f32|none").has_value());
  std::filesystem::remove_all(dir);
}

TEST(GemmCache, EntriesOfAnotherGpuDriverOrVersionAreIgnoredAndKept) {
  const std::string dir = temp_dir("other"), path = dir + "/gemm_choices.tsv";
  const std::string key = "4096x4096x4096*1|tn|bf16>f32|accumulate";
  {
    ChoiceCache c(path, kH200);
    c.store(key, {true, 1.0, 2.0});
  }
  for (const MachineKey& other : {MachineKey{"NVIDIA H100 80GB HBM3 sm_90 132SM", "13000", "0.1.0"},
                                  MachineKey{kH200.gpu, "12080", "0.1.0"}, MachineKey{kH200.gpu, "13000", "0.2.0"}}) {
    ChoiceCache c(path, other);
    EXPECT_FALSE(c.ignored_corrupt_file());
    EXPECT_FALSE(c.lookup(key).has_value()) << other.gpu << " " << other.driver << " " << other.kiln_version;
    c.store(key, {false, 3.0, 1.0});  // its own entry, beside the H200's
  }
  ChoiceCache h200(path, kH200);
  auto a = h200.lookup(key);
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->kiln);  // the other machines' stores did not replace it
  ChoiceCache h100(path, {"NVIDIA H100 80GB HBM3 sm_90 132SM", "13000", "0.1.0"});
  auto b = h100.lookup(key);
  ASSERT_TRUE(b.has_value());
  EXPECT_FALSE(b->kiln);
  std::filesystem::remove_all(dir);
}

TEST(GemmCache, CorruptFilesAreIgnoredWithAWarningAndReplaced) {
  const std::string dir = temp_dir("corrupt"), path = dir + "/gemm_choices.tsv";
  const std::string good_line = kH200.gpu + "\t" + kH200.driver + "\t" + kH200.kiln_version + "\tK\tkiln\t1.0\t2.0\n";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "empty"},
      {"not a header\n" + good_line, "first line"},
      {std::string(ChoiceCache::kHeader) + "\n" + good_line + "only\tthree\tfields\n", "fields"},
      {std::string(ChoiceCache::kHeader) + "\n" + kH200.gpu + "\t13000\t0.1.0\tK\tmaybe\t1\t2\n", "chooses"},
      {std::string(ChoiceCache::kHeader) + "\n" + kH200.gpu + "\t13000\t0.1.0\tK\tkiln\t-1\t2\n", "bad time"},
      {std::string(ChoiceCache::kHeader) + "\n" + kH200.gpu + "\t13000\t0.1.0\tK\tkiln\t1.0x\t2\n", "bad time"},
      {std::string("\x7f\x45\x4c\x46\x02\x01", 6) + "\n", "first line"},
  };
  for (const auto& [content, why] : bad) {
    {
      std::ofstream out(path, std::ios::trunc | std::ios::binary);
      out << content;
    }
    ::testing::internal::CaptureStderr();
    ChoiceCache c(path, kH200);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(c.ignored_corrupt_file()) << why;
    EXPECT_NE(err.find("warning: ignoring the GEMM choice cache"), std::string::npos) << why << ": " << err;
    EXPECT_NE(err.find(why), std::string::npos) << err;
    EXPECT_FALSE(c.lookup("K").has_value()) << why;  // not even the good line of a bad file
    c.store("K2", {true, 1.0, 2.0});
    ChoiceCache again(path, kH200);  // the store replaced the file with a good one
    EXPECT_FALSE(again.ignored_corrupt_file()) << why;
    EXPECT_TRUE(again.lookup("K2").has_value()) << why;
    EXPECT_EQ(read_all(path).rfind(ChoiceCache::kHeader, 0), 0u);
  }
  std::filesystem::remove_all(dir);
}

TEST(GemmCache, AnUnwritableFolderIsAWarningAndTheChoiceStaysInMemory) {
  const std::string dir = temp_dir("ro");
  const std::string file_as_dir = dir + "/plain_file";
  { std::ofstream(file_as_dir) << "x"; }
  ChoiceCache c(file_as_dir + "/gemm_choices.tsv", kH200);  // its folder is a file
  ::testing::internal::CaptureStderr();
  c.store("K", {true, 1.0, 2.0});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("cannot write the GEMM choice cache"), std::string::npos) << err;
  EXPECT_TRUE(c.lookup("K").has_value());
  std::filesystem::remove_all(dir);
}

TEST(GemmOptions, NamesParseAndTheEnvironmentSetsTheDefault) {
  for (Backend b : {Backend::automatic, Backend::cublaslt, Backend::kiln})
    EXPECT_EQ(parse_backend(backend_name(b), "test"), b);
  for (Epilogue e : kAllEpilogues) EXPECT_EQ(parse_epilogue(epilogue_name(e), "test"), e);
  try {
    parse_backend("cutlass", "KILN_GEMM_BACKEND");
    FAIL() << "no error";
  } catch (const kiln::Error& e) {
    EXPECT_NE(std::string(e.what()).find("KILN_GEMM_BACKEND: 'cutlass' is not a GEMM backend (expected auto, cublaslt or kiln)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(parse_epilogue("gelu", "--epilogue"), kiln::Error);
  ::setenv("KILN_GEMM_BACKEND", "cublaslt", 1);
  EXPECT_EQ(default_backend(), Backend::cublaslt);
  ::setenv("KILN_GEMM_BACKEND", "bogus", 1);
  EXPECT_THROW(default_backend(), kiln::Error);
  set_default_backend(Backend::kiln);  // the setter wins over the environment
  EXPECT_EQ(default_backend(), Backend::kiln);
  clear_default_backend();
  ::unsetenv("KILN_GEMM_BACKEND");
  EXPECT_EQ(default_backend(), kUnsetDefaultBackend);
  EXPECT_EQ(kUnsetDefaultBackend, Backend::cublaslt);
  EXPECT_EQ(row_stat_tiles(1), 1);
  EXPECT_EQ(row_stat_tiles(128), 1);
  EXPECT_EQ(row_stat_tiles(129), 2);
}

// The cache key names the shape, layout, dtypes and epilogue, and a block-sparse a apart from the
// dense problem (its time depends on the flags).
TEST(GemmCache, ProblemKeysNameLayoutDtypesEpilogueAndSparsity) {
  GemmProblem p;
  p.a = kiln::Tensor::empty({3, 5}, kiln::DType::bf16), p.b = kiln::Tensor::empty({7, 5}, kiln::DType::bf16);
  p.out = kiln::Tensor::empty({3, 7}, kiln::DType::f32);
  p.trans_b = true;
  EpilogueArgs e;
  e.kind = Epilogue::accumulate;
  EXPECT_EQ(problem_key(p, e), "3x7x5*1|nt|bf16>f32|accumulate");
  p.a_nonzero = kiln::Tensor::empty({1, 1}, kiln::DType::u8);
  EXPECT_EQ(problem_key(p, e), "3x7x5*1|nt|bf16>f32|accumulate|sparse");
}
