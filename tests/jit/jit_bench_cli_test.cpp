// `kiln bench jit`: its record (cold times alone and in the pool, the warm pair) on the CPU
// kernels, a cache folder of its own that it removes, and bad options refused by name.
#include <gtest/gtest.h>

#include <filesystem>

#include "kiln/io/json.h"
#include "kiln/jit/cpu_backend.h"
#include "tests/cli_run.h"
#include "tests/jit/jit_test_util.h"

using kiln::test::run_kiln;

TEST(JitBenchCli, TimesColdAndWarmCompilesOfTheCpuKernels) {
  if (!kiln::jit::find_cpu_compiler()) GTEST_SKIP() << "no C++ compiler on this machine";
  kiln::test::TempDir home;
  kiln::test::ScopedEnv tmp("TMPDIR", home.path.c_str());
  const auto r = run_kiln("bench jit --kind cpu --kernels 2");
  ASSERT_EQ(r.status, 0) << r.output;
  const size_t at = r.output.find("{\"bench\":\"jit\"");
  ASSERT_NE(at, std::string::npos) << r.output;
  const kiln::json::Value o = kiln::json::parse(r.output.substr(at, r.output.find('\n', at) - at));
  EXPECT_EQ(o.find("kind")->as_string("kind"), "cpu");
  EXPECT_EQ(o.find("kernels")->as_int("kernels"), 2);
  const double one = o.find("cold_one_s")->as_double(), par = o.find("cold_parallel_s")->as_double();
  EXPECT_GT(one, 0.0);
  EXPECT_GT(par, 0.0);
  EXPECT_NEAR(o.find("throughput_ratio")->as_double(), 2.0 * one / par, 1e-9);
  // A cache hit (dlopen of the stored object) is far below a compile.
  EXPECT_LT(o.find("warm_pair_ms")->as_double(), 1e3 * one) << r.output;
  EXPECT_FALSE(o.find("warm_includes_module_load")->as_bool("warm_includes_module_load"));
  // Its cache folder (under TMPDIR) is gone.
  EXPECT_TRUE(std::filesystem::is_empty(home.path)) << r.output;
}

TEST(JitBenchCli, BadOptionsAreRefusedByName) {
  auto r = run_kiln("bench jit --kind tpu");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--kind must be hopper, simt or cpu, got 'tpu'"), std::string::npos) << r.output;
  r = run_kiln("bench jit --kind cpu --kernels 0");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--kernels must be 1 to 64, got 0"), std::string::npos) << r.output;
}
