// Tests of matmul (1-D, 2-D, batched with broadcast, transposed views) and linear (with and
// without bias): float64 loop references, the harness (dtypes, layouts, finite differences)
// and bad-input errors.
#include <dlfcn.h>
#include <omp.h>

#include "kiln/kernels/blas_threads.h"
#include "kiln/kernels/matmul.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {

// Loop reference of a [B, m, k] @ b [B, k, n] with both already broadcast to B.
std::vector<double> bmm_ref(const Tensor& a, const Tensor& b) {
  auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  int64_t B = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  std::vector<double> out(static_cast<size_t>(B * m * n), 0.0);
  for (int64_t z = 0; z < B; ++z)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t q = 0; q < k; ++q) s += av[static_cast<size_t>((z * m + i) * k + q)] * bv[static_cast<size_t>((z * k + q) * n + j)];
        out[static_cast<size_t>((z * m + i) * n + j)] = s;
      }
  return out;
}

}  // namespace

TEST(Matmul, MatchesLoopsForEveryRankCombination) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    auto r = [&](Shape s) { return randn(s, gen, DType::f64, dev); };
    // 1-D · 1-D → scalar.
    Tensor v = r({7}), w = r({7});
    double dot = 0;
    auto vv = v.to_vector<double>(), wv = w.to_vector<double>();
    for (int i = 0; i < 7; ++i) dot += vv[static_cast<size_t>(i)] * wv[static_cast<size_t>(i)];
    Tensor y = matmul(v, w);
    EXPECT_EQ(y.dim(), 0);
    EXPECT_NEAR(y.item(), dot, 1e-12);
    // 2-D, 1-D on either side, batched with broadcast, transposed operands.
    Tensor a = r({5, 7}), b = r({7, 3});
    EXPECT_TRUE(all_close(matmul(a, b), from_vector(bmm_ref(a.view({1, 5, 7}), b.view({1, 7, 3})), {5, 3}), {1e-12, 1e-12}, "2-D"));
    EXPECT_TRUE(all_close(matmul(a, w), from_vector(bmm_ref(a.view({1, 5, 7}), w.view({1, 7, 1})), {5}), {1e-12, 1e-12}, "2-D·1-D"));
    EXPECT_TRUE(all_close(matmul(v, b), from_vector(bmm_ref(v.view({1, 1, 7}), b.view({1, 7, 3})), {3}), {1e-12, 1e-12}, "1-D·2-D"));
    Tensor at = r({7, 5}).t(), bt = r({3, 7}).t();
    EXPECT_TRUE(all_close(matmul(at, bt), from_vector(bmm_ref(at.contiguous().view({1, 5, 7}), bt.contiguous().view({1, 7, 3})), {5, 3}),
                          {1e-12, 1e-12}, "transposed"));
    Tensor ba = r({2, 1, 5, 7}), bb = r({3, 7, 4});
    Tensor yb = matmul(ba, bb);
    ASSERT_EQ(yb.shape(), (Shape{2, 3, 5, 4}));
    EXPECT_TRUE(all_close(yb, from_vector(bmm_ref(ba.expand({2, 3, 5, 7}).reshape({6, 5, 7}), bb.expand({2, 3, 7, 4}).reshape({6, 7, 4})),
                                          {2, 3, 5, 4}), {1e-12, 1e-12}, "batched broadcast"));
    // Batched · 1-D.
    EXPECT_EQ(matmul(ba, w).shape(), (Shape{2, 1, 5}));
    // linear = x Wᵀ + b.
    Tensor x = r({2, 3, 7}), W = r({4, 7}), bias = r({4});
    Tensor yl = linear(x, W, bias);
    ASSERT_EQ(yl.shape(), (Shape{2, 3, 4}));
    auto ref = bmm_ref(x.reshape({1, 6, 7}), W.t().contiguous().view({1, 7, 4}));
    auto bv = bias.to_vector<double>();
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += bv[i % 4];
    EXPECT_TRUE(all_close(yl, from_vector(ref, {2, 3, 4}), {1e-12, 1e-12}, "linear"));
    EXPECT_TRUE(all_close(linear(x, W), matmul(x, W.t()), {1e-12, 1e-12}, "linear without bias"));
  }
}

TEST(Matmul, Harness) {
  auto mm = [](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); };
  const std::vector<DType> all{DType::f64, DType::f32, DType::f16, DType::bf16};
  check_op({"matmul 2-D", {{{5, 7}}, {{7, 3}}}, mm, all, true, true, 4.0});
  check_op({"matmul 1-D·1-D", {{{7}}, {{7}}}, mm, all, true, true, 4.0});
  check_op({"matmul 1-D·2-D", {{{7}}, {{7, 1}}}, mm, all, true, true, 4.0});
  check_op({"matmul 2-D·1-D", {{{1, 7}}, {{7}}}, mm, all, true, true, 4.0});
  check_op({"matmul batched broadcast", {{{2, 1, 3, 4}}, {{3, 4, 2}}}, mm, all, true, true, 4.0});
  check_op({"matmul k=129", {{{2, 129}}, {{129, 2}}}, mm, all, true, true, 16.0});
  check_op({"linear bias", {{{2, 3, 7}}, {{4, 7}}, {{4}}},
            [](const std::vector<Tensor>& v) { return linear(v[0], v[1], v[2]); }, all, true, true, 4.0});
  check_op({"linear", {{{3, 5}}, {{2, 5}}}, [](const std::vector<Tensor>& v) { return linear(v[0], v[1]); }, all, true, true, 4.0});
}

// An empty inner dim (k = 0) gives zeros, as torch, plus the bias for linear, with gradients
// of the operands' empty shapes (linear's reshape to [-1, 0] was an error for 0 elements).
TEST(Matmul, EmptyInnerDimGivesZeros) {
  for (Device dev : test_devices()) {
    auto is_zeros = [](const Tensor& t) {
      for (double v : t.to_vector<double>())
        if (v != 0.0) return false;
      return true;
    };
    Tensor x = zeros({2, 0}, DType::f32, dev).requires_grad_(), w = zeros({3, 0}, DType::f32, dev).requires_grad_();
    Tensor y = linear(x, w);
    ASSERT_EQ(y.shape(), (Shape{2, 3}));
    EXPECT_TRUE(is_zeros(y));
    sum(y).backward();
    EXPECT_EQ(x.grad().shape(), (Shape{2, 0}));
    EXPECT_EQ(w.grad().shape(), (Shape{3, 0}));
    Tensor b = from_vector<float>({1, 2, 3}, {3}).to(dev).requires_grad_();
    Tensor yb = linear(zeros({4, 5, 0}, DType::f32, dev), w.detach(), b);
    ASSERT_EQ(yb.shape(), (Shape{4, 5, 3}));
    EXPECT_EQ(sum(yb, {0, 1}).to_vector<float>(), (std::vector<float>{20, 40, 60}));
    sum(yb).backward();
    EXPECT_EQ(b.grad().to_vector<float>(), (std::vector<float>{20, 20, 20}));
    EXPECT_EQ(linear(zeros({0}, DType::f32, dev), w.detach(), b).to_vector<float>(), (std::vector<float>{1, 2, 3}));
    Tensor a = zeros({2, 3, 0}, DType::f32, dev).requires_grad_(), m = zeros({2, 0, 4}, DType::f32, dev).requires_grad_();
    Tensor ym = matmul(a, m);
    ASSERT_EQ(ym.shape(), (Shape{2, 3, 4}));
    EXPECT_TRUE(is_zeros(ym));
    EXPECT_TRUE(is_zeros(matmul(a.detach(), zeros({0, 4}, DType::f32, dev))));
    sum(ym).backward();
    EXPECT_EQ(a.grad().shape(), (Shape{2, 3, 0}));
    EXPECT_EQ(m.grad().shape(), (Shape{2, 0, 4}));
  }
}

TEST(MatmulErrors, NameOpAndValues) {
  EXPECT_KILN_ERROR(matmul(zeros({2, 3}), zeros({4, 5})), "matmul", "3", "4");
  EXPECT_KILN_ERROR(matmul(zeros({2, 3}), zeros({3, 2}, DType::f64)), "matmul", "f32", "f64");
  EXPECT_KILN_ERROR(matmul(zeros({2, 2, 3}), zeros({3, 3, 2})), "matmul", "broadcast");
  EXPECT_KILN_ERROR(matmul(zeros({}), zeros({3})), "matmul");
  EXPECT_KILN_ERROR(linear(zeros({2, 3}), zeros({4, 5})), "linear", "[4, 5]");
  EXPECT_KILN_ERROR(linear(zeros({2, 3}), zeros({4, 3}), zeros({5})), "linear", "bias", "[5]");
}

// The CPU BLAS takes int sizes: a product with a dimension past 2^31 - 1 is an error (a cast
// wrapped: OpenBLAS refused on stderr and the output stayed zeros). The sizes are given to the
// kernel directly: operands that large do not fit a test machine; the check reads no data.
TEST(Matmul, CpuDimensionsPastIntAreAnError) {
  kernels::GemmArgs g;
  g.m = (int64_t{1} << 31) + 1, g.n = 1, g.k = 1;
  const Tensor a = zeros({2}), b = zeros({2}), out = zeros({2});
  EXPECT_KILN_ERROR(kernels::cpu::gemm(g, out, a, b), "matmul (CPU)", "past 2^31 - 1");
  g.m = 1, g.k = int64_t{1} << 32;
  EXPECT_KILN_ERROR(kernels::cpu::gemm(g, out, a, b), "matmul (CPU)", "past 2^31 - 1");
}

// With a BLAS that runs each call on one thread (a pthreads OpenBLAS as kiln sets it), large
// products are split over kiln's OpenMP threads (kernels/cpu/matmul.cpp): every layout, a
// batch, row and column splits and uneven blocks against the loop reference. This VM's
// OpenBLAS is set to one thread for the test (dlsym: skipped where the BLAS is not OpenBLAS).

TEST(Matmul, SplitOverKilnThreadsWhenTheBlasRunsOneThread) {
  using GetThreads = int (*)();
  using SetThreads = void (*)(int);
  auto get_threads = reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto set_threads = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!get_threads || !set_threads) GTEST_SKIP() << "the BLAS is not OpenBLAS";
  const int before = get_threads(), omp_before = omp_get_max_threads();
  set_threads(1);
  omp_set_num_threads(3);  // uneven blocks, and a split even on a 1-core machine
  EXPECT_TRUE(kernels::cpu::blas_runs_one_thread());
  KILN_TEST_GENERATOR(gen);
  struct Case { int64_t batch, m, k, n; };
  for (Case c : {Case{1, 301, 96, 200}, Case{2, 40, 300, 517}, Case{1, 517, 400, 24}})  // each past kSplitFlops
    for (int layout = 0; layout < 4; ++layout) {
      const bool ta = layout & 2, tb = layout & 1;
      Tensor a = ta ? randn({c.batch, c.k, c.m}, gen, DType::f64).transpose(1, 2) : randn({c.batch, c.m, c.k}, gen, DType::f64);
      Tensor b = tb ? randn({c.batch, c.n, c.k}, gen, DType::f64).transpose(1, 2) : randn({c.batch, c.k, c.n}, gen, DType::f64);
      Tensor f = matmul(a.to(DType::f32), b.to(DType::f32));
      const std::vector<double> ref = bmm_ref(a.contiguous(), b.contiguous());
      EXPECT_TRUE(all_close(f, from_vector(ref, {c.batch, c.m, c.n}), {1e-4, 1e-4}, "f32 split"))
          << "m=" << c.m << " k=" << c.k << " n=" << c.n << " layout " << layout;
      EXPECT_TRUE(all_close(matmul(a, b), from_vector(ref, {c.batch, c.m, c.n}), {1e-12, 1e-12}, "f64 split"));
    }
  set_threads(before);
  omp_set_num_threads(omp_before);
}
