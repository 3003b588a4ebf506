// CUDA vs CPU for the ops of kiln/ops/ops.h: elementwise (contiguous, non-contiguous,
// broadcast, packs with tails and unaligned views), where/masked_fill, reductions (warp- and block-per-row paths, NaN), softmax,
// matmul/linear in every float dtype (batched, broadcast, transposed), shape ops and views,
// casts, device round trips, RNG bits, autograd, and run-to-run determinism.
#include <functional>

#include "kiln/core/rng.h"
#include "tests/cuda/cuda_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

struct UnaryCase {
  const char* name;
  std::function<Tensor(const Tensor&)> fn;
  bool positive;  // needs inputs > 0
};

const std::vector<UnaryCase>& unary_cases() {
  static const std::vector<UnaryCase> v = {
      {"neg", [](const Tensor& x) { return neg(x); }, false},
      {"exp", [](const Tensor& x) { return exp(x); }, false},
      {"log", [](const Tensor& x) { return log(x); }, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, true},
      {"tanh", [](const Tensor& x) { return tanh(x); }, false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, false},
      {"silu", [](const Tensor& x) { return silu(x); }, false},
      {"gelu", [](const Tensor& x) { return gelu(x); }, false},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, true); }, false},
      {"abs", [](const Tensor& x) { return abs(x); }, false},
      {"relu", [](const Tensor& x) { return relu(x); }, false},
      {"add_scalar", [](const Tensor& x) { return add(x, 0.75); }, false},
      {"mul_scalar", [](const Tensor& x) { return mul(x, -1.5); }, false},
      {"pow", [](const Tensor& x) { return pow(x, 2.5); }, true},
  };
  return v;
}

Tensor input(const Shape& shape, Generator& gen, DType dt, bool positive = false) {
  Tensor x = randn(shape, gen, DType::f64);
  if (positive) x = add(abs(x), 0.1);
  return x.to(dt);
}

}  // namespace

TEST(CudaOps, UnaryMatchesCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(1);
  for (DType dt : float_dtypes()) {
    for (const auto& c : unary_cases()) {
      for (bool transposed : {false, true}) {
        Tensor x = transposed ? input({129, 7}, gen, dt, c.positive).t() : input({7, 129}, gen, dt, c.positive);
        Tensor want = c.fn(x);
        Tensor got = c.fn(x.to(gpu()));
        EXPECT_TRUE(got.is_cuda());
        EXPECT_TRUE(all_close(got, want, device_tol,
                              std::string(c.name) + " " + dtype_name(dt) + (transposed ? " (transposed)" : "")));
      }
    }
  }
}

TEST(CudaOps, BinaryBroadcastMatchesCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(2);
  using Fn = std::function<Tensor(const Tensor&, const Tensor&)>;
  const std::vector<std::pair<const char*, Fn>> ops = {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
      {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
      {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }},
      {"div", [](const Tensor& a, const Tensor& b) { return div(a, add(abs(b), 0.5)); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }},
      {"eq", [](const Tensor& a, const Tensor& b) { return eq(a, b); }},
      {"ne", [](const Tensor& a, const Tensor& b) { return ne(a, b); }},
      {"lt", [](const Tensor& a, const Tensor& b) { return lt(a, b); }},
      {"le", [](const Tensor& a, const Tensor& b) { return le(a, b); }},
      {"gt", [](const Tensor& a, const Tensor& b) { return gt(a, b); }},
      {"ge", [](const Tensor& a, const Tensor& b) { return ge(a, b); }},
  };
  for (DType dt : float_dtypes()) {
    // a: [7, 5, 129] non-contiguous (a permuted buffer); b: [5, 1] broadcast; c: [129] broadcast.
    Tensor a = input({129, 7, 5}, gen, dt).permute({1, 2, 0});
    Tensor b = input({5, 1}, gen, dt);
    Tensor c = input({129}, gen, dt);
    for (const auto& [name, fn] : ops) {
      EXPECT_TRUE(
          all_close(fn(a.to(gpu()), b.to(gpu())), fn(a, b), device_tol, std::string(name) + " a,b " + dtype_name(dt)));
      EXPECT_TRUE(
          all_close(fn(c.to(gpu()), a.to(gpu())), fn(c, a), device_tol, std::string(name) + " c,a " + dtype_name(dt)));
      EXPECT_TRUE(
          all_close(fn(a.to(gpu()), a.to(gpu())), fn(a, a), device_tol, std::string(name) + " a,a " + dtype_name(dt)));
    }
  }
  for (DType dt : {DType::i32, DType::i64, DType::i16, DType::u8}) {
    auto ints = [&](const Shape& s) {  // non-negative for u8 (negative floats to u8 are undefined)
      Tensor v = mul(randn(s, gen, DType::f64), 20.0);
      return (dt == DType::u8 ? abs(v) : v).to(dt);
    };
    Tensor a = ints({33, 65}), b = ints({65});
    for (const auto& [name, fn] : ops) {
      if (std::string(name) == "div") continue;  // integer division by zero is undefined
      EXPECT_TRUE(all_close(fn(a.to(gpu()), b.to(gpu())), fn(a, b), {0, 0}, std::string(name) + " " + dtype_name(dt)));
    }
  }
}

TEST(CudaOps, WhereAndMaskedFillMatchCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(3);
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    Tensor a = input({9, 1, 17}, gen, dt);
    Tensor b = input({9, 4, 17}, gen, dt).transpose(0, 2).contiguous().transpose(0, 2);
    Tensor cond = gt(randn({4, 1}, gen), zeros({1}));
    EXPECT_TRUE(all_close(where(cond.to(gpu()), a.to(gpu()), b.to(gpu())), where(cond, a, b), {0, 0},
                          std::string("where ") + dtype_name(dt)));
    EXPECT_TRUE(all_close(masked_fill(b.to(gpu()), cond.to(gpu()), -7.0), masked_fill(b, cond, -7.0), {0, 0},
                          std::string("masked_fill ") + dtype_name(dt)));
  }
}

TEST(CudaOps, ReductionsMatchCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(4);
  // Short rows (warp per row), long rows (block per row), a single very long row.
  const std::vector<Shape> shapes = {{1000, 7}, {33, 129}, {5, 4099}, {1, 100003}, {3, 1, 1}};
  for (DType dt : float_dtypes()) {
    for (const Shape& s : shapes) {
      Tensor x = input(s, gen, dt);
      Tensor xg = x.to(gpu());
      const int64_t cols = s[1];
      // 16-bit: one output rounding (the f32 vs f64 accumulation difference is far below it);
      // f32/f64: accumulation differences that grow like sqrt(cols).
      const double r = device_tol(dt).rtol;
      const double sum_atol = dt == DType::f64   ? 1e-12 * std::sqrt(double(cols)) * 4
                              : dt == DType::f32 ? 1e-5 * std::sqrt(double(cols)) * 4
                                                 : r;
      std::string what = std::string(dtype_name(dt)) + " " + shape_str(s);
      EXPECT_TRUE(all_close(sum(xg, {1}), sum(x, {1}), {sum_atol, r}, "sum dim 1 " + what));
      EXPECT_TRUE(all_close(sum(xg, {0}), sum(x, {0}), {sum_atol * 8, r}, "sum dim 0 " + what));
      EXPECT_TRUE(all_close(mean(xg, {1}, true), mean(x, {1}, true), {sum_atol, r}, "mean keepdim " + what));
      EXPECT_TRUE(all_close(amax(xg, {1}), amax(x, {1}), {0, 0}, "amax " + what));
      EXPECT_TRUE(all_close(amax(xg), amax(x), {0, 0}, "amax all " + what));
      ValuesIndices want = max(x, 1), got = max(xg, 1);
      EXPECT_TRUE(all_close(got.values, want.values, {0, 0}, "max values " + what));
      EXPECT_TRUE(all_close(got.indices, want.indices, {0, 0}, "max indices " + what));
      EXPECT_TRUE(all_close(argmax(xg, 0), argmax(x, 0), {0, 0}, "argmax dim 0 " + what));
    }
  }
  // Whole-tensor sum of a non-contiguous input.
  Tensor x = input({65, 257}, gen, DType::f32).t();
  EXPECT_TRUE(all_close(sum(x.to(gpu())), sum(x), {1e-3, 1e-5}, "sum all transposed"));
  // Integer sums are exact.
  Tensor xi = mul(randn({17, 300}, gen, DType::f64), 100.0).to(DType::i32);
  EXPECT_TRUE(all_close(sum(xi.to(gpu()), {1}), sum(xi, {1}), {0, 0}, "sum i32"));
  EXPECT_TRUE(all_close(amax(xi.to(gpu()), {0}), amax(xi, {0}), {0, 0}, "amax i32"));
}

TEST(CudaOps, MaxPropagatesNaNLikeCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(5);
  for (int64_t cols : {7, 1000}) {
    std::vector<float> v = randn({4, cols}, gen).to_vector<float>();
    v[static_cast<size_t>(1 * cols + 3)] = NAN;
    v[static_cast<size_t>(1 * cols + cols - 1)] = NAN;
    v[static_cast<size_t>(3 * cols + cols - 1)] = NAN;
    Tensor x = from_vector(v, {4, cols});
    Tensor xg = x.to(gpu());
    EXPECT_TRUE(all_close(amax(xg, {1}), amax(x, {1}), {0, 0}, "amax with NaN"));
    ValuesIndices want = max(x, 1), got = max(xg, 1);
    EXPECT_TRUE(all_close(got.values, want.values, {0, 0}, "max values with NaN"));
    EXPECT_EQ(want.indices.to_vector<int64_t>(), got.indices.to_vector<int64_t>()) << "cols " << cols;
    EXPECT_EQ(got.indices.to_vector<int64_t>()[1], 3);
    EXPECT_TRUE(std::isnan(sum(xg, {1}).to_vector<float>()[1]));
  }
}

TEST(CudaOps, SoftmaxMatchesCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(6);
  for (DType dt : float_dtypes()) {
    Tensor x = mul(input({13, 1031}, gen, dt), 4.0);
    Tensor xg = x.to(gpu());
    const double r = device_tol(dt).rtol * 4;
    EXPECT_TRUE(all_close(softmax(xg, -1), softmax(x, -1), {r, r}, std::string("softmax -1 ") + dtype_name(dt)));
    EXPECT_TRUE(all_close(softmax(xg, 0), softmax(x, 0), {r, r}, std::string("softmax 0 ") + dtype_name(dt)));
    EXPECT_TRUE(
        all_close(log_softmax(xg, -1), log_softmax(x, -1), {r * 10, r}, std::string("log_softmax ") + dtype_name(dt)));
  }
}

TEST(CudaOps, MatmulMatchesCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(7);
  struct Case {
    Shape a, b;
    bool ta, tb;  // build the operand transposed (a non-contiguous view)
  };
  const std::vector<Case> cases = {
      {{7, 129}, {129, 5}, false, false}, {{1, 1}, {1, 1}, false, false},   {{64, 128}, {128, 96}, true, true},
      {{3, 7, 9}, {3, 9, 11}, false, false}, {{2, 3, 7, 9}, {9, 11}, false, true}, {{7, 9}, {4, 9, 11}, true, false},
      {{129}, {129, 3}, false, false},    {{5, 130}, {130}, false, false},
  };
  for (DType dt : float_dtypes()) {
    for (const Case& c : cases) {
      auto make = [&](const Shape& s, bool t) {
        if (!t || s.size() < 2) return input(s, gen, dt);
        Shape st = s;
        std::swap(st[st.size() - 1], st[st.size() - 2]);
        const int64_t nd = static_cast<int64_t>(s.size());
        return input(st, gen, dt).transpose(nd - 1, nd - 2);
      };
      Tensor a = make(c.a, c.ta), b = make(c.b, c.tb);
      const int64_t k = c.a.back();
      // Sums of k products of unit normals: errors grow like sqrt(k) roundings of the output.
      // f32/f64: accumulation-order differences (~sqrt(k)); 16-bit: both accumulate in f32, so
      // the outputs differ by about one rounding.
      const double tol = dt == DType::f64   ? 1e-12 * std::sqrt(double(k))
                         : dt == DType::f32 ? 1e-5 * std::sqrt(double(k))
                                            : device_tol(dt).rtol * 2;
      std::string what = std::string("matmul ") + dtype_name(dt) + " " + shape_str(c.a) + (c.ta ? "ᵀ" : "") + " @ " +
                         shape_str(c.b) + (c.tb ? "ᵀ" : "");
      EXPECT_TRUE(all_close(matmul(a.to(gpu()), b.to(gpu())), matmul(a, b), {tol, tol}, what));
    }
    Tensor x = input({6, 33}, gen, dt), w = input({17, 33}, gen, dt), bias = input({17}, gen, dt);
    const double tol = dt == DType::f64   ? 1e-11
                       : dt == DType::f32 ? 1e-4
                                          : device_tol(dt).rtol * 8;  // matmul, then + bias
    EXPECT_TRUE(all_close(linear(x.to(gpu()), w.to(gpu()), bias.to(gpu())), linear(x, w, bias), {tol, tol},
                          std::string("linear ") + dtype_name(dt)));
  }
}

TEST(CudaOps, ShapeOpsAndViewsMatchCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(8);
  Tensor a = input({4, 5, 6}, gen, DType::f32), b = input({4, 2, 6}, gen, DType::f32);
  Tensor ag = a.to(gpu()), bg = b.to(gpu());
  EXPECT_TRUE(all_close(cat({ag, bg}, 1), cat({a, b}, 1), {0, 0}, "cat"));
  EXPECT_TRUE(all_close(stack({ag, ag}, 0), stack({a, a}, 0), {0, 0}, "stack"));
  auto ps = split(a, 2, 1), pg = split(ag, 2, 1);
  ASSERT_EQ(ps.size(), pg.size());
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_TRUE(all_close(pg[i].contiguous(), ps[i].contiguous(), {0, 0}, "split"));
  EXPECT_TRUE(all_close(ag.permute({2, 0, 1}).contiguous(), a.permute({2, 0, 1}).contiguous(), {0, 0}, "permute"));
  EXPECT_TRUE(all_close(ag.slice(2, 1, 6, 2).contiguous(), a.slice(2, 1, 6, 2).contiguous(), {0, 0}, "slice step 2"));
  EXPECT_TRUE(all_close(ag.select(1, 3).contiguous(), a.select(1, 3).contiguous(), {0, 0}, "select"));
  EXPECT_TRUE(all_close(ag.slice(0, 1, 3).expand({2, 2, 5, 6}).contiguous(),
                        a.slice(0, 1, 3).expand({2, 2, 5, 6}).contiguous(), {0, 0}, "expand"));
  EXPECT_TRUE(
      all_close(ag.transpose(0, 2).reshape({30, 4}), a.transpose(0, 2).reshape({30, 4}), {0, 0}, "reshape copy"));
  // In-place copy_ into a strided view, across devices, and fill_ of a view.
  Tensor dst = zeros({6, 10}), dstg = zeros({6, 10}, DType::f32, gpu());
  dst.slice(1, 0, 10, 2).copy_(a.select(0, 0).t());
  dstg.slice(1, 0, 10, 2).copy_(a.select(0, 0).t());  // CPU source into a CUDA view
  dst.select(0, 5).fill_(3.5);
  dstg.select(0, 5).fill_(3.5);
  EXPECT_TRUE(all_close(dstg, dst, {0, 0}, "copy_ and fill_ into views"));
}

TEST(CudaOps, CastsMatchCpuBitForBit) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(9);
  const std::vector<DType> all = {DType::f64, DType::f32, DType::f16, DType::bf16, DType::i64,
                                  DType::i32, DType::i16, DType::i8,  DType::u8,   DType::boolean};
  // Values in [-100, 100] with fractions and exact zeros (for bool), non-contiguous.
  Tensor base = mul(randn({31, 9}, gen, DType::f64), 40.0);
  base = where(gt(abs(base), full({1}, 70.0, DType::f64)), zeros({1}, DType::f64), base).t();
  for (DType from : all) {
    Tensor src = base.to(from);
    if (from == DType::u8) src = abs(base).to(from);
    Tensor srcg = src.to(gpu());
    for (DType to : all) {
      // Negative floating values to u8 are undefined in C++: cast their magnitudes instead.
      Tensor s = (is_floating(from) && to == DType::u8) ? abs(src) : src;
      Tensor sg = (is_floating(from) && to == DType::u8) ? abs(srcg) : srcg;
      EXPECT_TRUE(same_bits(sg.to(to), s.to(to), std::string("cast ") + dtype_name(from) + " -> " + dtype_name(to)));
    }
  }
}

// The packed path of the elementwise launcher (NOTE [packed elementwise]): lengths around the
// pack sizes (2 to 16 elements a pack) take packs and a tail, views one element in take the
// element-wise path (unaligned), every dtype width; unary, binary, comparison, cast and fill;
// then transposed operands, packed along their contiguous innermost dim.
TEST(CudaOps, PackedElementwiseTailsAndUnalignedViews) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(21);
  const std::vector<DType> dtypes = {DType::f64, DType::f32, DType::bf16, DType::f16, DType::i64, DType::u8};
  for (int64_t n : {1, 3, 7, 8, 9, 15, 16, 17, 33, 1027, 70001}) {
    for (DType dt : dtypes) {
      Tensor v = mul(randn({2, n + 1}, gen, DType::f64), is_floating(dt) ? 1.0 : 20.0);
      Tensor base = (dt == DType::u8 ? abs(v) : v).to(dt), baseg = base.to(gpu());
      for (int64_t at : {0, 1}) {
        const std::string what = std::to_string(n) + " " + dtype_name(dt) + (at ? " (view at 1)" : "");
        Tensor x = base.select(0, 0).narrow(0, at, n), y = base.select(0, 1).narrow(0, at, n);
        Tensor xg = baseg.select(0, 0).narrow(0, at, n), yg = baseg.select(0, 1).narrow(0, at, n);
        EXPECT_TRUE(same_bits(add(xg, yg), add(x, y), "add " + what));
        EXPECT_TRUE(same_bits(lt(xg, yg), lt(x, y), "lt " + what));
        if (is_floating(dt)) {
          EXPECT_TRUE(all_close(silu(xg), silu(x), device_tol, "silu " + what));
        }
        for (DType to : {DType::f32, DType::bf16, DType::f64, DType::boolean})
          EXPECT_TRUE(same_bits(xg.to(to), x.to(to), "cast to " + std::string(dtype_name(to)) + " " + what));
      }
      EXPECT_TRUE(
          same_bits(full({n}, 3.0, dt, gpu()), full({n}, 3.0, dt), "fill " + std::to_string(n) + " " + dtype_name(dt)));
    }
  }
  // Strided operands whose innermost dim is contiguous (a [B, T, H, D] <-> [B, H, T, D]
  // transpose) take packs along it when D is a multiple of the pack (else one by one).
  for (DType dt : dtypes) {
    for (int64_t D : {2, 8, 12, 16, 64}) {
      Tensor v = mul(randn({2, 2, 5, 3, D}, gen, DType::f64), is_floating(dt) ? 1.0 : 20.0);
      Tensor b = (dt == DType::u8 ? abs(v) : v).to(dt), bg = b.to(gpu());
      Tensor x = b.select(0, 0).transpose(1, 2), y = b.select(0, 1).transpose(1, 2);
      Tensor xg = bg.select(0, 0).transpose(1, 2), yg = bg.select(0, 1).transpose(1, 2);
      const std::string what = "D=" + std::to_string(D) + " " + dtype_name(dt);
      EXPECT_TRUE(same_bits(xg.contiguous(), x.contiguous(), "transposed copy " + what));
      EXPECT_TRUE(same_bits(xg.to(DType::f32), x.to(DType::f32), "transposed cast " + what));
      EXPECT_TRUE(same_bits(add(xg, yg), add(x, y), "transposed add " + what));
    }
  }
}

TEST(CudaOps, DeviceRoundTripsKeepBits) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(10);
  for (DType dt : {DType::f64, DType::f32, DType::f16, DType::bf16, DType::i64, DType::i32, DType::i8, DType::u8,
                   DType::boolean}) {
    Tensor v = mul(randn({3, 1001}, gen, DType::f64), 10.0);
    Tensor x = (dt == DType::u8 ? abs(v) : v).to(dt);  // negative floats to u8 are undefined in C++
    Tensor back = x.to(gpu()).to(kCPU);
    EXPECT_TRUE(back.is_cpu());
    EXPECT_TRUE(same_bits(back, x, std::string("round trip ") + dtype_name(dt)));
    EXPECT_TRUE(
        same_bits(x.to(gpu()).t().contiguous(), x.t().contiguous(), std::string("transpose on gpu ") + dtype_name(dt)));
  }
  // Storage-only f8: bytes travel and are copied (strided) unchanged.
  Tensor raw = mul(abs(randn({8, 16}, gen, DType::f64)), 40.0).to(DType::u8);
  Tensor f8 = Tensor::empty({8, 16}, DType::f8_e4m3);
  std::memcpy(f8.data_ptr(), raw.data_ptr(), raw.nbytes());
  Tensor f8g = f8.to(gpu());
  EXPECT_TRUE(same_bits(f8g, f8, "f8 round trip"));
  EXPECT_TRUE(same_bits(f8g.t().contiguous(), f8.t().contiguous(), "f8 strided copy"));
  EXPECT_THROW(f8g.to(DType::f32), Error);
  // Empty tensors.
  EXPECT_EQ(zeros({0, 5}).to(gpu()).to(kCPU).shape(), (Shape{0, 5}));
}

TEST(CudaOps, FactoriesMatchCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i64, DType::i32}) {
    EXPECT_TRUE(same_bits(arange(-3.0, 50.0, 0.75, dt, gpu()), arange(-3.0, 50.0, 0.75, dt),
                          std::string("arange ") + dtype_name(dt)));
    EXPECT_TRUE(
        same_bits(full({5, 7}, -2.25, dt, gpu()), full({5, 7}, -2.25, dt), std::string("full ") + dtype_name(dt)));
  }
}

TEST(CudaOps, RandomNumbersMatchCpuBits) {
  KILN_SKIP_WITHOUT_CUDA();
  for (DType dt : float_dtypes()) {
    Generator g1(1234), g2(1234);
    for (int draw = 0; draw < 3; ++draw) {
      Shape s{1 << 20 | 7};
      Tensor u = rand(s, g1, dt), ug = rand(s, g2, dt, gpu());
      EXPECT_TRUE(same_bits(ug, u, std::string("rand ") + dtype_name(dt)));
      Tensor n = randn(s, g1, dt), ng = randn(s, g2, dt, gpu());
      if (dt == DType::f64)  // device log/cos may differ from glibc's by an ulp in f64
        EXPECT_TRUE(all_close(ng, n, {1e-14, 1e-14}, "randn f64"));
      else
        EXPECT_TRUE(same_bits(ng, n, std::string("randn ") + dtype_name(dt)));
    }
    EXPECT_EQ(g1.offset, g2.offset);
  }
}

TEST(CudaOps, BackwardMatchesCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(11);
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor x = input({6, 10}, gen, dt), w = input({8, 10}, gen, dt), b = input({8}, gen, dt);
    Tensor t = input({6, 8}, gen, dt);
    std::vector<Tensor> grads[2];
    Tensor losses[2];
    for (int dev = 0; dev < 2; ++dev) {
      Device d = dev == 0 ? kCPU : gpu();
      Tensor xd = x.to(d).detach().requires_grad_(), wd = w.to(d).detach().requires_grad_();
      Tensor bd = b.to(d).detach().requires_grad_();
      Tensor h = silu(linear(xd, wd, bd));
      Tensor y = mul(softmax(h, -1), t.to(d));
      Tensor loss = add(sum(y), mean(log_softmax(gelu(h, true), 0)));
      loss = add(loss, sum(amax(mul(h, h), {1})));
      loss.backward();
      losses[dev] = loss.detach();
      grads[dev] = {xd.grad(), wd.grad(), bd.grad()};
      for (const Tensor& g : grads[dev]) ASSERT_TRUE(g.defined());
      for (const Tensor& g : grads[dev]) EXPECT_EQ(g.device(), d);
    }
    const double tol = dt == DType::f64 ? 1e-10 : 1e-4;
    EXPECT_TRUE(all_close(losses[1], losses[0], {tol, tol}, std::string("loss ") + dtype_name(dt)));
    const char* names[] = {"dx", "dw", "db"};
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(all_close(grads[1][i], grads[0][i], {tol, tol}, std::string(names[i]) + " " + dtype_name(dt)));
  }
}

TEST(CudaOps, ResultsAreDeterministic) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(12);
  Tensor x = input({300, 5000}, gen, DType::f32).to(gpu());
  Tensor w = input({5000, 257}, gen, DType::bf16).to(gpu());
  auto run = [&] {
    return std::vector<Tensor>{sum(x, {1}), sum(x, {0}), sum(x), softmax(x, -1), matmul(x.to(DType::bf16), w),
                               max(x, 0).indices};
  };
  std::vector<Tensor> r1 = run(), r2 = run();
  for (size_t i = 0; i < r1.size(); ++i) EXPECT_TRUE(same_bits(r2[i], r1[i], "run-to-run result " + std::to_string(i)));
}

TEST(CudaOps, BadInputsGiveErrors) {
  KILN_SKIP_WITHOUT_CUDA();
  Tensor a = ones({3}, DType::f32, gpu());
  EXPECT_THROW(add(a, ones({3})), Error);  // devices differ
  EXPECT_THROW(ones({3}, DType::f32, cuda(cuda_device_count())), Error);
  EXPECT_THROW(amax(ones({0}, DType::f32, gpu())), Error);  // an empty reduction (a bool sum is an i64 count now)
  EXPECT_EQ(sum(ones({3}, DType::boolean, gpu())).item(), 3.0);
}
