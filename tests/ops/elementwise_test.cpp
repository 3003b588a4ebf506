// Tests of the elementwise ops: every unary op (incl. scalar variants), binary ops with
// broadcasting, comparisons (with ties), where/masked_fill, the in-place add_/mul_, and their
// bad-input errors. Each op runs through the harness (dtypes, layouts, finite differences)
// and against an independent per-element float64 reference. Also the CUDA launcher's
// magic-number division (kernels/divmod.h), on the host.
#include <cmath>

#include "kiln/kernels/divmod.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {

struct UnaryCase {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  std::function<double(double)> ref;
  bool positive;  // domain (0.5, 1.5)
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"neg", [](const Tensor& x) { return neg(x); }, [](double x) { return -x; }, false},
      {"exp", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }, false},
      {"log", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double x) { return std::sqrt(x); }, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double x) { return 1 / std::sqrt(x); }, true},
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double x) { return std::tanh(x); }, false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, [](double x) { return 1 / (1 + std::exp(-x)); }, false},
      {"silu", [](const Tensor& x) { return silu(x); }, [](double x) { return x / (1 + std::exp(-x)); }, false},
      {"gelu", [](const Tensor& x) { return gelu(x); },
       [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }, false},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, true); },
       [](double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }, false},
      {"abs", [](const Tensor& x) { return abs(x); }, [](double x) { return std::fabs(x); }, false},
      {"relu", [](const Tensor& x) { return relu(x); }, [](double x) { return x > 0 ? x : 0; }, false},
      {"pow", [](const Tensor& x) { return pow(x, 2.5); }, [](double x) { return std::pow(x, 2.5); }, true},
      {"add_scalar", [](const Tensor& x) { return x + 1.25; }, [](double x) { return x + 1.25; }, false},
      {"sub_scalar", [](const Tensor& x) { return x - 0.5; }, [](double x) { return x - 0.5; }, false},
      {"mul_scalar", [](const Tensor& x) { return x * -3.0; }, [](double x) { return x * -3.0; }, false},
      {"div_scalar", [](const Tensor& x) { return x / 4.0; }, [](double x) { return x / 4.0; }, false},
      {"rmul_scalar", [](const Tensor& x) { return 2.0 * x; }, [](double x) { return 2.0 * x; }, false},
  };
}

}  // namespace

TEST(Unary, HarnessAndReference) {
  KILN_TEST_GENERATOR(gen);
  for (const auto& c : unary_cases()) {
    SCOPED_TRACE(c.name);
    for (Shape s : {Shape{1}, Shape{129}, Shape{3, 7}}) {
      Input in = c.positive ? positive(s) : Input{s};
      check_op({c.name, {in}, [op = c.op](const std::vector<Tensor>& v) { return op(v[0]); }});
    }
    for (Device dev : test_devices()) {
      Tensor x = c.positive ? add(rand({2, 7}, gen, DType::f64, dev), 0.5) : mul(randn({2, 7}, gen, DType::f64, dev), 2.0);
      auto xv = x.to_vector<double>(), yv = c.op(x).to_vector<double>();
      for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(yv[i], c.ref(xv[i]), 1e-12 * (1 + std::fabs(c.ref(xv[i])))) << xv[i];
    }
  }
}

// pow(x, 0)'s gradient is 0, also at x = 0 (as torch; it was 0 · 0^-1 = NaN).
TEST(Unary, PowZeroHasZeroGradient) {
  for (Device dev : test_devices()) {
    Tensor x = from_vector<double>({0, 2}, {2}).to(dev).requires_grad_();
    sum(pow(x, 0.0)).backward();
    EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 0}));
  }
}

// relu keeps NaN, as torch (x > 0 ? x : 0 made it 0).
TEST(Unary, ReluKeepsNaN) {
  for (Device dev : test_devices())
    for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
      const Tensor x = from_vector<double>({NAN, -1, 2}, {3}).to(dt).to(dev);
      const std::vector<double> y = relu(x).to(DType::f64).to_vector<double>();
      EXPECT_TRUE(std::isnan(y[0])) << dev.str() << " " << dtype_name(dt);
      EXPECT_EQ(y[1], 0.0);
      EXPECT_EQ(y[2], 2.0);
    }
}

// relu's backward as torch's threshold_backward on the result: the gradient passes where
// !(relu(x) <= 0), so at a NaN input too (x > 0 ? 1 : 0 gave 0); 0 at 0 and below.
TEST(Unary, ReluBackwardPassesGradientAtNaN) {
  for (Device dev : test_devices())
    for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
      Tensor x = from_vector<double>({NAN, -1, 0, -0.0, 2}, {5}).to(dt).to(dev).requires_grad_();
      sum(relu(x)).backward();
      EXPECT_EQ(x.grad().to(DType::f64).to_vector<double>(), (std::vector<double>{1, 0, 0, 0, 1}))
          << dev.str() << " " << dtype_name(dt);
      // An inf or NaN gradient where x <= 0 still gives 0 (selected, as threshold_backward; g · 0 was NaN).
      Tensor w = from_vector<double>({-1, 0, 3}, {3}).to(dt).to(dev).requires_grad_();
      Tensor g = from_vector<double>({INFINITY, NAN, INFINITY}, {3}).to(dt).to(dev);
      sum(mul(relu(w), g)).backward();
      const std::vector<double> wg = w.grad().to(DType::f64).to_vector<double>();
      EXPECT_EQ(wg[0], 0.0) << dev.str() << " " << dtype_name(dt);
      EXPECT_EQ(wg[1], 0.0) << dev.str() << " " << dtype_name(dt);
      EXPECT_EQ(wg[2], INFINITY) << dev.str() << " " << dtype_name(dt);
    }
}

namespace {

struct BinaryCase {
  const char* name;
  std::function<Tensor(const Tensor&, const Tensor&)> op;
  std::function<double(double, double)> ref;
};

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }, [](double a, double b) { return a + b; }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }, [](double a, double b) { return a - b; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }, [](double a, double b) { return a * b; }},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }, [](double a, double b) { return a / b; }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); },
       [](double a, double b) { return std::max(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); },
       [](double a, double b) { return std::min(a, b); }},
  };
}

const std::vector<std::pair<Shape, Shape>> kBroadcastShapes = {
    {{7}, {7}}, {{3, 1, 5}, {4, 1}}, {{1}, {2, 3}}, {{2, 3}, {}}, {{129}, {1}}};

}  // namespace

TEST(Binary, HarnessAndReferenceWithBroadcasting) {
  KILN_TEST_GENERATOR(gen);
  for (const auto& c : binary_cases()) {
    SCOPED_TRACE(c.name);
    bool is_div = std::string(c.name) == "div";
    for (const auto& [sa, sb] : kBroadcastShapes) {
      OpCase oc{c.name, {{sa}, is_div ? positive(sb) : Input{sb}},
                [op = c.op](const std::vector<Tensor>& v) { return op(v[0], v[1]); }};
      // div by a broadcast scalar: its gradient -sum(g a) / b^2 sums 129 terms of size up to
      // 1 / b^2 that cancel, so the 16-bit rounding of each term is absolute, not relative to the
      // (small) sum: a bf16 draw was 0.09 off at 0.27 (atol 0.064); 4x covers ~4 sigma of it.
      if (is_div && sb == Shape{1} && sa == Shape{129}) oc.tol_scale = 4;
      check_op(oc);
      for (Device dev : test_devices()) {
        Tensor a = randn(sa, gen, DType::f64, dev), b = add(rand(sb, gen, DType::f64, dev), 0.5);
        Tensor y = c.op(a, b);
        Shape s = broadcast_shapes(sa, sb, "test");
        ASSERT_EQ(y.shape(), s);
        auto av = a.expand(s).to_vector<double>(), bv = b.expand(s).to_vector<double>(), yv = y.to_vector<double>();
        for (size_t i = 0; i < yv.size(); ++i) EXPECT_DOUBLE_EQ(yv[i], c.ref(av[i], bv[i]));
      }
    }
  }
}

// maximum / minimum gradients as PyTorch's: a tie shares the gradient half and half (kiln sent
// it all to a before), a NaN sends it to both.
TEST(Binary, MaximumMinimumTiesShareTheGradient) {
  for (Device dev : test_devices()) {
    for (bool is_max : {true, false}) {
      Tensor a = from_vector(std::vector<double>{1, 2, 3, NAN}, {4}, dev).requires_grad_();
      Tensor b = from_vector(std::vector<double>{1, 5, 0, 4}, {4}, dev).requires_grad_();
      sum(is_max ? maximum(a, b) : minimum(a, b)).backward();
      const std::vector<double> ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
      EXPECT_EQ(ga, (std::vector<double>{0.5, is_max ? 0.0 : 1.0, is_max ? 1.0 : 0.0, 1}));
      EXPECT_EQ(gb, (std::vector<double>{0.5, is_max ? 1.0 : 0.0, is_max ? 0.0 : 1.0, 1}));
    }
  }
}

TEST(Comparison, AllSixWithTiesAndBroadcasting) {
  KILN_TEST_GENERATOR(gen);
  using Cmp = std::function<Tensor(const Tensor&, const Tensor&)>;
  std::vector<std::tuple<const char*, Cmp, std::function<bool(double, double)>>> cases = {
      {"eq", [](auto& a, auto& b) { return eq(a, b); }, [](double a, double b) { return a == b; }},
      {"ne", [](auto& a, auto& b) { return ne(a, b); }, [](double a, double b) { return a != b; }},
      {"lt", [](auto& a, auto& b) { return lt(a, b); }, [](double a, double b) { return a < b; }},
      {"le", [](auto& a, auto& b) { return le(a, b); }, [](double a, double b) { return a <= b; }},
      {"gt", [](auto& a, auto& b) { return gt(a, b); }, [](double a, double b) { return a > b; }},
      {"ge", [](auto& a, auto& b) { return ge(a, b); }, [](double a, double b) { return a >= b; }},
  };
  for (Device dev : test_devices()) {
    for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
      // Small integers: many ties.
      Tensor a = mul(rand({4, 7}, gen, DType::f64, dev), 3.0).to(DType::i64).to(dt);
      Tensor b = mul(rand({7}, gen, DType::f64, dev), 3.0).to(DType::i64).to(dt);
      auto av = a.to_vector<double>(), bv = b.expand({4, 7}).to_vector<double>();
      for (auto& [name, op, ref] : cases) {
        Tensor y = op(a, strided_copy(b));
        EXPECT_EQ(y.dtype(), DType::boolean) << name;
        auto yv = y.to_vector<bool>();
        for (size_t i = 0; i < yv.size(); ++i) EXPECT_EQ(yv[i], ref(av[i], bv[i])) << name << " " << av[i] << " " << bv[i];
      }
    }
  }
}

TEST(Where, HarnessAndMaskedFill) {
  check_op({"where", {bmask({3, 1, 5}), {{4, 1}}, {{5}}},
            [](const std::vector<Tensor>& v) { return where(v[0], v[1], v[2]); }});
  check_op({"masked_fill", {{{3, 7}}, bmask({7})}, [](const std::vector<Tensor>& v) { return masked_fill(v[0], v[1], -2.5); }});
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    Tensor x = randn({3, 7}, gen, DType::f32, dev);
    Tensor m = lt(rand({3, 7}, gen, DType::f32, dev), full({}, 0.5, DType::f32, dev));
    auto xv = x.to_vector<double>(), yv = masked_fill(x, m, -1e9).to_vector<double>();
    auto mv = m.to_vector<bool>();
    for (size_t i = 0; i < xv.size(); ++i) EXPECT_EQ(yv[i], mv[i] ? static_cast<double>(-1e9f) : xv[i]);
    // Integer where.
    Tensor wi = where(m, full({}, 1, DType::i64, dev), full({3, 7}, 2, DType::i64, dev));
    auto wv = wi.to_vector<int64_t>();
    for (size_t i = 0; i < wv.size(); ++i) EXPECT_EQ(wv[i], mv[i] ? 1 : 2);
  }
}

TEST(InPlace, AddMulBumpVersionAndBroadcast) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    Tensor a = randn({3, 5}, gen, DType::f32, dev);
    Tensor b = randn({5}, gen, DType::f32, dev);
    auto av = a.to_vector<float>(), bv = b.to_vector<float>();
    uint64_t v0 = a.version();
    add_(a, b, -0.5);
    EXPECT_GT(a.version(), v0);
    auto r = a.to_vector<float>();
    for (size_t i = 0; i < r.size(); ++i) EXPECT_NEAR(r[i], av[i] - 0.5f * bv[i % 5], 1e-6);
    mul_(a, 2.0);
    auto r2 = a.to_vector<float>();
    for (size_t i = 0; i < r2.size(); ++i) EXPECT_FLOAT_EQ(r2[i], 2 * r[i]);
    // In place through a view writes the base.
    Tensor base = zeros({4, 4}, DType::f32, dev);
    Tensor col = base.select(1, 2);
    add_(col, ones({4}, DType::f32, dev));
    auto bvv = base.to_vector<float>();
    for (int i = 0; i < 16; ++i) EXPECT_EQ(bvv[static_cast<size_t>(i)], i % 4 == 2 ? 1.0f : 0.0f);
  }
}

TEST(ElementwiseErrors, NameOpAndValues) {
  Tensor a = zeros({2, 3}), b = zeros({4});
  EXPECT_KILN_ERROR(add(a, b), "add", "[2, 3]", "[4]", "cannot be broadcast");
  EXPECT_KILN_ERROR(mul(a, zeros({2, 3}, DType::f16)), "mul", "dtype mismatch", "f32", "f16");
  EXPECT_KILN_ERROR(lt(a, zeros({3}, DType::i64)), "lt", "dtype mismatch", "i64");
  EXPECT_KILN_ERROR(exp(zeros({2}, DType::i64)), "exp", "floating", "i64");
  EXPECT_KILN_ERROR(where(zeros({2, 3}), a, a), "where", "bool", "f32");
  EXPECT_KILN_ERROR(where(zeros({2, 3}, DType::boolean), a, b), "where", "cannot be broadcast");
  Tensor w = zeros({3});
  EXPECT_KILN_ERROR(add_(w, zeros({3}, DType::f64)), "add_", "dtype mismatch");
  Tensor leaf = zeros({3}).requires_grad_();
  EXPECT_KILN_ERROR(mul_(leaf, 2.0), "mul_");
  EXPECT_KILN_ERROR(add(a, Tensor()), "add", "undefined");
  if (cuda_device_count() > 0)
    EXPECT_KILN_ERROR(add(a, zeros({2, 3}, DType::f32, cuda(0))), "add", "device mismatch", "cpu", "cuda:0");
  // Integer division by zero is an error (the hardware trap, SIGFPE, killed the process), and
  // INT_MIN / -1 wraps instead of trapping.
  for (DType dt : {DType::i64, DType::i32, DType::i8}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor num = full({3}, 7, dt), den = from_vector(std::vector<double>{1, 0, 2}, {3}).to(dt);
    EXPECT_KILN_ERROR(div(num, den), "div: integer division by zero", "holds a 0");
    EXPECT_EQ(div(num, full({3}, 2, dt)).to(DType::f64).to_vector<double>(), (std::vector<double>{3, 3, 3}));
  }
  EXPECT_EQ(div(full({1}, static_cast<double>(INT32_MIN), DType::i32), full({1}, -1, DType::i32)).to_vector<int32_t>(),
            std::vector<int32_t>{INT32_MIN});
  EXPECT_EQ(div(full({1}, -128, DType::i8), full({1}, -1, DType::i8)).to(DType::i32).to_vector<int32_t>(),
            std::vector<int32_t>{-128});
  EXPECT_EQ(div(full({2}, 1.0), zeros({2})).to_vector<float>()[0], INFINITY);  // floats divide by zero as IEEE says
}

// The vectorised f32 SiLU (contiguous f32 on CPU: kernels/cpu/vec_math.cpp) and its derivative
// vs float64, over the whole range (large |x|, zero, odd lengths across the vector tails),
// NaN propagation, and non-contiguous inputs (the generic path) giving the same values.
TEST(Unary, SiluF32FastPathMatchesFloat64) {
  KILN_TEST_GENERATOR(gen);
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{129}, int64_t{40000}}) {
    Tensor x64 = mul(randn({n}, gen, DType::f64), 8.0);
    std::vector<double> xv = x64.to_vector<double>();
    const std::vector<double> edges{0.0, -0.0, 100.0, -100.0, 88.5, -88.5, 1e-30, -1e-30};
    for (size_t i = 0; i < edges.size() && i < xv.size(); ++i) xv[i] = edges[i];
    Tensor x = from_vector(xv, {n}).to(DType::f32).requires_grad_();
    Tensor y = silu(x);
    sum(y).backward();
    std::vector<double> xf = x.detach().to(DType::f64).to_vector<double>();
    std::vector<double> yv = y.detach().to(DType::f64).to_vector<double>();
    std::vector<double> gv = x.grad().to(DType::f64).to_vector<double>();
    for (size_t i = 0; i < xf.size(); ++i) {
      const double s = 1 / (1 + std::exp(-xf[i]));
      const double want_y = xf[i] * s, want_g = s * (1 + xf[i] * (1 - s));
      // relative float rounding; below 1e-35 (x < -80) results may flush to 0
      EXPECT_NEAR(yv[i], want_y, 4e-7 * std::fabs(want_y) + 1e-35) << "silu(" << xf[i] << ")";
      // silu' = s·(1 + x·(1 − s)) cancels near x = -1.28: rounding scales with its terms
      EXPECT_NEAR(gv[i], want_g, 4e-7 * s * (1 + std::fabs(xf[i])) + 1e-35) << "silu'(" << xf[i] << ")";
    }
  }
  Tensor nan = from_vector(std::vector<float>{std::nanf(""), 1.0f}, {2});
  std::vector<float> yn = silu(nan).to_vector<float>();
  EXPECT_TRUE(std::isnan(yn[0]));
  // non-contiguous (generic loop, libm exp) vs contiguous (vectorised): float rounding apart
  Tensor m = randn({33, 17}, gen, DType::f32);
  std::vector<float> a = silu(m.transpose(0, 1)).contiguous().to_vector<float>();
  std::vector<float> b = silu(m).transpose(0, 1).contiguous().to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 4e-7 * (1 + std::fabs(b[i])));
}

// The CUDA launcher's 32-bit division by magic numbers (kernels/divmod.h), checked on the host
// against plain division: every divisor shape (1, powers of two and their neighbours, primes,
// the largest below 2^31) with dividends at the edges and at random below 2^31.
TEST(DivMod32, MatchesDivisionBelowTwoToThe31) {
  std::vector<uint32_t> divisors = {1, 2, 3, 5, 7, 31, 32, 33, 127, 128, 129, 1000, 4096, 65535, 65536, 65537,
                                    1000003, (1u << 30) - 1, 1u << 30, (1u << 30) + 1, (1u << 31) - 1};
  Generator gen(17);
  Tensor r = rand({2000}, gen, DType::f64);
  const std::vector<double> u = r.to_vector<double>();
  for (size_t i = 0; i < 200; ++i) divisors.push_back(1 + static_cast<uint32_t>(u[i] * ((1u << 31) - 2)));
  for (uint32_t d : divisors) {
    const kernels::DivMod32 dm(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 2 * d - 1, (1u << 31) - 1, (1u << 31) - 2};
    for (size_t i = 200; i < 2000; i += 9) ns.push_back(static_cast<uint32_t>(u[i] * ((1u << 31) - 1)));
    for (uint32_t n : ns) {
      if (n >= (1u << 31)) continue;  // 2d - 1 past the range
      ASSERT_EQ(dm.div(n), n / d) << n << " / " << d;
    }
  }
}
