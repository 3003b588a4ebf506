// Tests of own_blas_core (kernels/blas_core.h): on a CPU with AVX2 + FMA a DYNAMIC_ARCH OpenBLAS
// ends on AVX2 or AVX-512 kernels (the fallback to Prescott is replaced), OPENBLAS_CORETYPE and
// KILN_BLAS_CORE=keep are respected, and f32 / f64 products on the chosen kernels still match a
// float64 loop. ctest runs each case in its own process, so each one chooses before any BLAS call.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "kiln/kernels/blas_core.h"
#include "kiln/kernels/cpu/isa/isa.h"
#include "kiln/kernels/matmul.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {

bool cpu_has_avx2_fma() {
  const kernels::cpu::isa::CpuFeatures& f = kernels::cpu::isa::cpu_features();
  return f.avx2 && f.fma;
}

bool is_pre_avx2_core(const std::string& core) {
  for (const char* old : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Sandybridge", "Katmai",
                          "Coppermine", "Northwood", "Banias", "Opteron", "Barcelona", "Nano"})
    if (core == old) return true;
  return false;
}

// a [m, k] @ b [k, n] against a float64 loop, in `dtype`.
void expect_product_matches_loops(DType dtype, double tol) {
  KILN_TEST_GENERATOR(gen);
  const int64_t m = 67, k = 129, n = 45;  // past every kernel's register block, with tails
  Tensor a = randn({m, k}, gen, DType::f64), b = randn({k, n}, gen, DType::f64);
  auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  std::vector<double> ref(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t q = 0; q < k; ++q) ref[static_cast<size_t>(i * n + j)] += av[static_cast<size_t>(i * k + q)] * bv[static_cast<size_t>(q * n + j)];
  Tensor y = matmul(a.to(dtype), b.to(dtype)).to(DType::f64);
  EXPECT_TRUE(all_close(y, from_vector(ref, {m, n}), {tol, tol}, dtype_name(dtype)));
}

}  // namespace

TEST(BlasCore, AVectorCpuRunsVectorKernels) {
  ::unsetenv("OPENBLAS_CORETYPE");
  ::unsetenv("KILN_BLAS_CORE");
  const std::string said = kernels::cpu::own_blas_core();
  const std::string core = kernels::cpu::blas_core_name();
  if (core.empty()) GTEST_SKIP() << "not OpenBLAS: " << said;
  if (said.find("built for one CPU") != std::string::npos) GTEST_SKIP() << said;
  if (!cpu_has_avx2_fma()) GTEST_SKIP() << "no AVX2 + FMA here (" << said << ")";
  EXPECT_FALSE(is_pre_avx2_core(core)) << said;
  EXPECT_NE(said.find(core), std::string::npos) << "the report names the core in use: " << said;
  expect_product_matches_loops(DType::f32, 1e-4);
  expect_product_matches_loops(DType::f64, 1e-12);
}

TEST(BlasCore, OpenblasCoretypeIsLeftAlone) {
  ::setenv("OPENBLAS_CORETYPE", "Prescott", 1);  // read by OpenBLAS when this process loaded it
  const std::string before = kernels::cpu::blas_core_name();
  const std::string said = kernels::cpu::own_blas_core();
  if (kernels::cpu::blas_core_name().empty()) GTEST_SKIP() << "not OpenBLAS: " << said;
  if (said.find("built for one CPU") != std::string::npos) GTEST_SKIP() << said;
  EXPECT_NE(said.find("OPENBLAS_CORETYPE=Prescott"), std::string::npos) << said;
  EXPECT_EQ(kernels::cpu::blas_core_name(), before) << said;
  ::unsetenv("OPENBLAS_CORETYPE");
}

TEST(BlasCore, KeepLeavesOpenblasOwnPick) {
  ::unsetenv("OPENBLAS_CORETYPE");
  ::setenv("KILN_BLAS_CORE", "keep", 1);
  const std::string before = kernels::cpu::blas_core_name();
  const std::string said = kernels::cpu::own_blas_core();
  if (before.empty()) GTEST_SKIP() << "not OpenBLAS: " << said;
  EXPECT_EQ(kernels::cpu::blas_core_name(), before) << said;
  EXPECT_EQ(std::getenv("OPENBLAS_CORETYPE"), nullptr);
  ::unsetenv("KILN_BLAS_CORE");
  expect_product_matches_loops(DType::f32, 1e-4);
}
