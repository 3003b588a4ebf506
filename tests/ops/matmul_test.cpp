// Tests of matmul (1-D, 2-D, batched with broadcast, transposed views) and linear (with and
// without bias): float64 loop references, the harness (dtypes, layouts, finite differences)
// and bad-input errors.
#include <omp.h>

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

// The CPU kernel with an empty inner dimension scales out by beta (it left out as it was for any
// beta but 0), and never reads out at beta 0.
TEST(Matmul, CpuEmptyInnerDimScalesByBeta) {
  for (double beta : {0.0, 1.0, 0.5, -2.0}) {
    kernels::GemmArgs g;
    g.m = 2, g.n = 3, g.k = 0, g.beta = beta;
    Tensor out = from_vector<float>({1, 2, 3, 4, 5, std::nanf("")}, {2, 3});
    kernels::cpu::gemm(g, out, zeros({2, 0}, DType::f32), zeros({0, 3}, DType::f32));
    const auto got = out.to_vector<float>();
    for (int i = 0; i < 5; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], float(beta * (i + 1))) << "beta " << beta;
    if (beta == 0.0) EXPECT_EQ(got[5], 0.0f);  // a NaN out is not read at beta 0
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
// batch, row and column splits, uneven blocks and beta = 1 against the loop reference. The
// split is forced (gemm_split_over_threads), since the test cannot choose the OpenBLAS the
// machine installed; the BLAS thread count is left alone (setting an OpenMP OpenBLAS to one
// thread and calling it from a parallel region hung once on CI).
TEST(Matmul, SplitOverKilnThreadsGivesEveryBlockItsOperands) {
  const int omp_before = omp_get_max_threads();
  omp_set_num_threads(3);  // uneven blocks, and a split even on a 1-core machine
  KILN_TEST_GENERATOR(gen);
  struct Case { int64_t batch, m, k, n; };
  for (Case c : {Case{1, 301, 96, 200}, Case{2, 40, 300, 517}, Case{1, 517, 400, 24}})  // row and column splits
    for (DType dt : {DType::f32, DType::f64})
      for (int layout = 0; layout < 4; ++layout) {
        kernels::GemmArgs g;
        g.batch = c.batch, g.m = c.m, g.n = c.n, g.k = c.k, g.trans_a = layout & 2, g.trans_b = layout & 1;
        g.batch_stride_a = c.m * c.k, g.batch_stride_b = c.k * c.n;
        // Stored as the BLAS reads them: a [B, k, m] when transposed, b [B, n, k] when transposed.
        Tensor a64 = g.trans_a ? randn({c.batch, c.k, c.m}, gen, DType::f64) : randn({c.batch, c.m, c.k}, gen, DType::f64);
        Tensor b64 = g.trans_b ? randn({c.batch, c.n, c.k}, gen, DType::f64) : randn({c.batch, c.k, c.n}, gen, DType::f64);
        const std::vector<double> ref = bmm_ref(g.trans_a ? a64.transpose(1, 2).contiguous() : a64,
                                                g.trans_b ? b64.transpose(1, 2).contiguous() : b64);
        Tensor out = full({c.batch, c.m, c.n}, std::nan(""), dt);  // a block left unwritten stays NaN
        kernels::cpu::gemm_split_over_threads(g, out, a64.to(dt), b64.to(dt));
        const double tol = dt == DType::f32 ? 1e-4 : 1e-12;
        EXPECT_TRUE(all_close(out, ref, {tol, tol}, "split"))
            << dtype_name(dt) << " m=" << c.m << " k=" << c.k << " n=" << c.n << " layout " << layout;
        g.beta = 1.0;  // accumulates into what each block wrote
        kernels::cpu::gemm_split_over_threads(g, out, a64.to(dt), b64.to(dt));
        std::vector<double> twice(ref);
        for (double& v : twice) v *= 2;
        EXPECT_TRUE(all_close(out, twice, {tol, tol}, "split, beta 1"));
      }
  omp_set_num_threads(omp_before);
}
