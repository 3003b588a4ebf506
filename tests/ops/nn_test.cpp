// Tests of the neural-network ops (embedding, rms_norm, swiglu, rotary_embedding/rotary_tables,
// cross_entropy, dropout): harness runs (dtypes, layouts, finite-difference gradients),
// independent float64 loop references, kernels called directly with poisoned outputs, and
// bad-input errors.
#include <cmath>
#include <tuple>

#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/nn.h"
#include "kiln/ops/fused.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {

std::vector<double> v64(const Tensor& t) { return t.to_vector<double>(); }
std::vector<int64_t> vi(const Tensor& t) { return t.to(DType::i64).to_vector<int64_t>(); }

}  // namespace

// ---- embedding ----

TEST(Embedding, Harness) {
  for (int64_t d : {1, 7, 129}) {
    check_op({"embedding", {{{11, d}}, idx({2, 5}, 11)}, [](const std::vector<Tensor>& in) {
                return embedding(in[0], in[1]);
              }});
  }
}

TEST(Embedding, MatchesLoopReferenceWithRepeatedIds) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    for (DType idt : {DType::i64, DType::i32}) {
      const int64_t v = 6, d = 5;
      Tensor w = randn({v, d}, gen, DType::f64, dev).requires_grad_();
      std::vector<int64_t> ids_v{3, 0, 3, 5, 3, 1, 0, 3, 5, 2, 3, 3};  // many repeats, id 4 unused
      Tensor ids = from_vector(ids_v, {3, 4}, dev).to(idt);
      Tensor y = embedding(w, ids);
      ASSERT_EQ(y.shape(), (Shape{3, 4, d}));
      Tensor g = randn(y.shape(), gen, DType::f64, dev);
      y.backward(g);
      auto wv = v64(w), yv = v64(y), gv = v64(g), dw = v64(w.grad());
      std::vector<double> dref(static_cast<size_t>(v * d), 0.0);
      for (size_t n = 0; n < ids_v.size(); ++n)
        for (int64_t c = 0; c < d; ++c) {
          EXPECT_EQ(yv[n * d + c], wv[ids_v[n] * d + c]);
          dref[ids_v[n] * d + c] += gv[n * d + c];
        }
      for (size_t k = 0; k < dref.size(); ++k) EXPECT_NEAR(dw[k], dref[k], 1e-12) << k;
    }
  }
}

TEST(Embedding, BackwardKernelWritesEveryRowOfPoisonedOutput) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    Tensor ids = from_vector(std::vector<int64_t>{2, 2, 0}, {3}, dev);
    Tensor g = randn({3, 4}, gen, DType::f32, dev);
    Tensor dw = full({5, 4}, std::nan(""), DType::f32, dev);
    KILN_DEVICE_CALL(dev, embedding_backward, dw, g, ids);
    auto d = v64(dw), gv = v64(g);
    for (int64_t c = 0; c < 4; ++c) {
      EXPECT_FLOAT_EQ(d[static_cast<size_t>(0 * 4 + c)], gv[static_cast<size_t>(2 * 4 + c)]);
      EXPECT_FLOAT_EQ(d[static_cast<size_t>(2 * 4 + c)], static_cast<float>(gv[static_cast<size_t>(c)] + gv[static_cast<size_t>(4 + c)]));
      for (int64_t r : {1, 3, 4}) EXPECT_EQ(d[static_cast<size_t>(r * 4 + c)], 0.0);
    }
  }
}

TEST(Embedding, BadInputs) {
  for (Device dev : test_devices()) {
    Tensor w = zeros({10, 3}, DType::f32, dev);
    std::vector<int64_t> ids(20, 1);
    ids[17] = 70000;
    // On CUDA the range check is deferred to the next host read (to(kCPU) here); on CPU it is immediate.
    EXPECT_KILN_ERROR(embedding(w, from_vector(ids, {20}, dev)).to(kCPU), "embedding: ids[17]=70000 out of range [0, 10)");
    ids[17] = -1;
    EXPECT_KILN_ERROR(embedding(w, from_vector(ids, {4, 5}, dev)).to(kCPU), "ids[17]=-1", "[0, 10)");
    // the failure is reported once: later good calls read back fine
    ids[17] = 9;
    EXPECT_EQ(embedding(w, from_vector(ids, {4, 5}, dev)).to(kCPU).numel(), 60);
    EXPECT_KILN_ERROR(embedding(w, zeros({3}, DType::f32, dev)), "embedding", "i64 or i32", "f32");
    EXPECT_KILN_ERROR(embedding(zeros({10}, DType::f32, dev), zeros({3}, DType::i64, dev)), "embedding", "2-D", "[10]");
    EXPECT_KILN_ERROR(embedding(zeros({10, 3}, DType::i64, dev), zeros({3}, DType::i64, dev)), "embedding", "floating");
  }
}

// ---- rms_norm ----

TEST(RmsNorm, Harness) {
  for (int64_t d : {1, 7, 129}) {
    check_op({"rms_norm", {{{3, d}}, {{d}}}, [](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1], 1e-5); }});
  }
  check_op({"rms_norm 3-D", {{{2, 3, 8}}, {{8}}}, [](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1]); }});
  check_op({"rms_norm x only", {{{4, 6}}, nograd({6})}, [](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1]); }});
}

TEST(RmsNorm, MatchesLoopReference) {
  KILN_TEST_GENERATOR(gen);
  // More rows than one block of the dweight partial sums (130), and than the CUDA kernels' 512
  // row groups (1100, unevenly); head dims in packs and not (CUDA: 2 f64 a pack).
  for (Device dev : test_devices())
    for (auto [rows, d] : {std::pair<int64_t, int64_t>{130, 7}, {1100, 16}, {130, 264}}) {
      const double eps = 1e-3;
      Tensor x = randn({rows, d}, gen, DType::f64, dev).requires_grad_();
      Tensor w = randn({d}, gen, DType::f64, dev).requires_grad_();
      Tensor y = rms_norm(x, w, eps);
      Tensor g = randn({rows, d}, gen, DType::f64, dev);
      y.backward(g);
      auto xv = v64(x), wv = v64(w), yv = v64(y), gv = v64(g), dx = v64(x.grad()), dw = v64(w.grad());
      std::vector<double> dwr(static_cast<size_t>(d), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        double ss = 0, dot = 0;
        for (int64_t c = 0; c < d; ++c) ss += xv[r * d + c] * xv[r * d + c];
        double rs = 1.0 / std::sqrt(ss / d + eps);
        for (int64_t c = 0; c < d; ++c) {
          EXPECT_NEAR(yv[r * d + c], xv[r * d + c] * rs * wv[c], 1e-12);
          dot += gv[r * d + c] * wv[c] * xv[r * d + c];
          dwr[c] += gv[r * d + c] * xv[r * d + c] * rs;
        }
        for (int64_t c = 0; c < d; ++c)
          EXPECT_NEAR(dx[r * d + c], gv[r * d + c] * wv[c] * rs - xv[r * d + c] * dot * rs * rs * rs / d, 1e-10);
      }
      for (int64_t c = 0; c < d; ++c) EXPECT_NEAR(dw[c], dwr[c], 1e-9 * rows);
    }
}

TEST(RmsNorm, BadInputs) {
  Tensor x = zeros({2, 4});
  EXPECT_KILN_ERROR(rms_norm(x, zeros({5})), "rms_norm", "weight shape [5]", "[2, 4]");
  EXPECT_KILN_ERROR(rms_norm(x, zeros({4}, DType::f16)), "rms_norm", "dtype mismatch", "f16");
  EXPECT_KILN_ERROR(rms_norm(x, zeros({4}), -1.0), "rms_norm", "eps", "-1");
  EXPECT_KILN_ERROR(rms_norm(zeros({2, 4}, DType::i32), zeros({4}, DType::i32)), "rms_norm", "floating", "i32");
}

// ---- swiglu ----

TEST(Swiglu, Harness) {
  auto fn = [](const std::vector<Tensor>& in) { return swiglu(in[0], in[1]); };
  check_op({"swiglu", {{{3, 5}}, {{3, 5}}}, fn});
  check_op({"swiglu odd", {{{7, 129}}, {{7, 129}}}, fn});
  check_op({"swiglu 3-D up only", {{{2, 3, 8}}, nograd({2, 3, 8})}, fn});
}

// The fused op against silu(gate) · up from the plain ops, values and both gradients, on every
// device; lengths in packs (CUDA: 16 bytes) and not.
TEST(Swiglu, MatchesComposedOps) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices())
    for (DType dt : {DType::f64, DType::f32, DType::bf16})
      for (int64_t n : {8, 1027}) {
        const std::string what = dev.str() + " " + dtype_name(dt) + " n=" + std::to_string(n);
        Tensor g0 = mul(randn({3, n}, gen, DType::f64, dev), 3.0).to(dt), u0 = randn({3, n}, gen, DType::f64, dev).to(dt);
        Tensor d = randn({3, n}, gen, DType::f64, dev).to(dt);
        Tensor g1 = g0.detach().requires_grad_(), u1 = u0.detach().requires_grad_();
        Tensor g2 = g0.detach().requires_grad_(), u2 = u0.detach().requires_grad_();
        Tensor y1 = swiglu(g1, u1), y2 = mul(silu(g2), u2);
        y1.backward(d);
        y2.backward(d);
        // bf16: the composed ops round silu(g) first; the fused op rounds once.
        const double tol = dt == DType::f64 ? 1e-12 : dt == DType::f32 ? 1e-5 : 2e-2;
        auto close = [&](const Tensor& a, const Tensor& b, const char* which) {
          auto av = v64(a), bv = v64(b);
          ASSERT_EQ(av.size(), bv.size());
          for (size_t i = 0; i < av.size(); ++i)
            ASSERT_NEAR(av[i], bv[i], tol * (1 + std::abs(bv[i]))) << which << " " << what << " at " << i;
        };
        close(y1, y2, "out");
        close(g1.grad(), g2.grad(), "dgate");
        close(u1.grad(), u2.grad(), "dup");
      }
}

// swiglu_linear (ops/fused.h): the harness (f64 reference, finite differences, every dtype and
// device), the unfused pair's bits for the output and the three gradients, and its errors.
TEST(Fused, SwigluLinearHarness) {
  auto fn = [](const std::vector<Tensor>& in) { return swiglu_linear(in[0], in[1], in[2]); };
  check_op({"swiglu_linear", {{{3, 5}}, {{3, 5}}, {{4, 5}}}, fn});
  check_op({"swiglu_linear 3-D, weight only", {nograd({2, 3, 8}), nograd({2, 3, 8}), {{6, 8}}}, fn});
}

TEST(Fused, SwigluLinearGivesTheUnfusedBits) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices())
    for (DType dt : {DType::f64, DType::f32, DType::bf16})
      for (int64_t in : {8, 131}) {
        const std::string what = dev.str() + " " + dtype_name(dt) + " in=" + std::to_string(in);
        Tensor g0 = randn({2, 5, in}, gen, DType::f64, dev).to(dt), u0 = randn({2, 5, in}, gen, DType::f64, dev).to(dt);
        Tensor w0 = randn({7, in}, gen, DType::f64, dev).to(dt), d = randn({2, 5, 7}, gen, DType::f64, dev).to(dt);
        Tensor g1 = g0.detach().requires_grad_(), u1 = u0.detach().requires_grad_(), w1 = w0.detach().requires_grad_();
        Tensor g2 = g0.detach().requires_grad_(), u2 = u0.detach().requires_grad_(), w2 = w0.detach().requires_grad_();
        Tensor y1 = swiglu_linear(g1, u1, w1), y2 = linear(swiglu(g2, u2), w2);
        y1.backward(d);
        y2.backward(d);
        for (const auto& [a, b, which] : {std::tuple{y1, y2, "out"}, {g1.grad(), g2.grad(), "dgate"},
                                          {u1.grad(), u2.grad(), "dup"}, {w1.grad(), w2.grad(), "dweight"}})
          EXPECT_TRUE(same_bits(a, b, std::string(which) + " " + what));
      }
  EXPECT_KILN_ERROR(swiglu_linear(zeros({2, 3}), zeros({2, 4}), zeros({5, 3})), "swiglu_linear", "gate shape");
  EXPECT_KILN_ERROR(swiglu_linear(zeros({2, 3}), zeros({2, 3}), zeros({5, 4})), "swiglu_linear", "weight [5, 4]");
  EXPECT_KILN_ERROR(swiglu_linear(zeros({2, 3}), zeros({2, 3}), zeros({5, 3}, DType::f64)), "swiglu_linear",
                    "dtype mismatch");
}

TEST(Swiglu, BadInputs) {
  EXPECT_KILN_ERROR(swiglu(zeros({2, 3}), zeros({3, 2})), "swiglu", "gate shape [2, 3]", "up shape [3, 2]");
  EXPECT_KILN_ERROR(swiglu(zeros({2, 3}), zeros({2, 3}, DType::f64)), "swiglu", "dtype mismatch", "f64");
  EXPECT_KILN_ERROR(swiglu(zeros({2}, DType::i32), zeros({2}, DType::i32)), "swiglu", "floating", "i32");
  EXPECT_KILN_ERROR(swiglu(Tensor(), zeros({2})), "swiglu", "gate", "undefined");
}

// ---- rotary ----

TEST(Rotary, TablesAsLlamaComputesThem) {
  const int64_t t = 9, d = 8;
  const double theta = 500000.0;
  auto [c, s] = rotary_tables(t, d, theta);
  ASSERT_EQ(c.shape(), (Shape{t, d}));
  ASSERT_EQ(c.dtype(), DType::f32);
  auto cv = v64(c), sv = v64(s);
  for (int64_t p = 0; p < t; ++p)
    for (int64_t j = 0; j < d; ++j) {
      double inv = 1.0 / std::pow(theta, static_cast<double>(2 * (j % (d / 2))) / d);
      EXPECT_EQ(cv[p * d + j], static_cast<float>(std::cos(p * inv)));
      EXPECT_EQ(sv[p * d + j], static_cast<float>(std::sin(p * inv)));
    }
  EXPECT_KILN_ERROR(rotary_tables(4, 7, 10000.0), "rotary_tables", "head_dim", "7");
}

TEST(Rotary, MatchesHuggingFaceFormula) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    const int64_t b = 2, h = 3, t = 5, d = 6;
    Tensor x = randn({b, h, t, d}, gen, DType::f64, dev);
    auto [c, s] = rotary_tables(t, d, 10000.0, dev);
    auto y = v64(rotary_embedding(x, c, s));
    auto xv = v64(x), cv = v64(c), sv = v64(s);
    for (int64_t r = 0; r < b * h; ++r)
      for (int64_t p = 0; p < t; ++p)
        for (int64_t j = 0; j < d; ++j) {
          const double* xr = &xv[static_cast<size_t>((r * t + p) * d)];
          double rot = j < d / 2 ? -xr[j + d / 2] : xr[j - d / 2];
          EXPECT_NEAR(y[static_cast<size_t>((r * t + p) * d + j)], xr[j] * cv[p * d + j] + rot * sv[p * d + j], 1e-6);
        }
  }
}

// f32 rows (the vectorised row loop on the CPU): every element of the output and of x's gradient
// is the double sum of its two products rounded once to f32, bit for bit, at head dims across the
// vector widths (odd half, 16, 64 lanes and one past).
TEST(Rotary, F32ElementsAreTheDoubleSumRoundedOnce) {
  KILN_TEST_GENERATOR(gen);
  for (int64_t d : {2, 6, 32, 128, 130}) {
    const int64_t rows = 3, t = 4, half = d / 2;
    Tensor c = randn({t, d}, gen, DType::f32), s = randn({t, d}, gen, DType::f32);
    Tensor x = randn({rows, t, d}, gen, DType::f32).requires_grad_();
    Tensor g = randn({rows, t, d}, gen, DType::f32);
    Tensor y = rotary_embedding(x, c, s);
    sum(mul(y, g)).backward();
    const auto xv = x.detach().to_vector<float>(), gv = g.to_vector<float>(), cv = c.to_vector<float>(),
               sv = s.to_vector<float>(), yv = y.detach().to_vector<float>(), dxv = x.grad().to_vector<float>();
    int64_t bad = 0;
    for (int64_t r = 0; r < rows * t; ++r)
      for (int64_t j = 0; j < d; ++j) {
        const int64_t p = r % t, at = r * d + j, tab = p * d;
        const auto X = [&](int64_t i) { return double(xv[static_cast<size_t>(r * d + i)]); };
        const auto G = [&](int64_t i) { return double(gv[static_cast<size_t>(r * d + i)]); };
        const auto C = [&](int64_t i) { return double(cv[static_cast<size_t>(tab + i)]); };
        const auto S = [&](int64_t i) { return double(sv[static_cast<size_t>(tab + i)]); };
        const float want_y = float(j < half ? X(j) * C(j) - X(j + half) * S(j) : X(j) * C(j) + X(j - half) * S(j));
        const float want_dx = float(j < half ? G(j) * C(j) + G(j + half) * S(j + half)
                                             : G(j) * C(j) - G(j - half) * S(j - half));
        if ((yv[static_cast<size_t>(at)] != want_y || dxv[static_cast<size_t>(at)] != want_dx) && bad++ < 5)
          ADD_FAILURE() << "D=" << d << " row " << r << " col " << j << ": y " << yv[static_cast<size_t>(at)]
                        << " (want " << want_y << "), dx " << dxv[static_cast<size_t>(at)] << " (want " << want_dx << ")";
      }
    EXPECT_EQ(bad, 0) << "D=" << d;
  }
}

TEST(Rotary, Harness) {
  auto fn = [](const std::vector<Tensor>& in) { return rotary_embedding(in[0], in[1], in[2]); };
  // Fused path: f32 [T, D] tables (random, so the backward must be the exact adjoint).
  Input tab{{5, 8}, Input::normal, 0, false, false};
  check_op({"rotary", {{{2, 3, 5, 8}}, tab, tab}, fn});
  check_op({"rotary odd T", {{{1, 1, 7, 2}}, {{7, 2}, Input::normal, 0, false, false}, {{7, 2}, Input::normal, 0, false, false}}, fn});
  // Composite path: tables broadcast [B, 1, T, D] that need gradients.
  check_op({"rotary composite", {{{2, 3, 5, 4}}, {{2, 1, 5, 4}}, {{2, 1, 5, 4}}}, fn});
}

// q of [B, T, H, D] seen as [B, H, T, D] (a transposed view, the head dim contiguous) is read in
// place and its gradient written in its layout: the same bits as on a contiguous copy, for head
// dims in packs of 4 pairs and not (D = 8, 6), every float width.
TEST(Rotary, TransposedViewsMatchContiguousBits) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices())
    for (DType dt : {DType::f64, DType::f32, DType::bf16})
      for (int64_t d : {8, 6}) {
        const int64_t b = 2, t = 5, h = 3;
        auto [c, s] = rotary_tables(t, d, 10000.0, dev);
        Tensor buf = randn({b, t, h, d}, gen, DType::f64, dev).to(dt);
        Tensor w = randn({b, h, t, d}, gen, DType::f64, dev).to(dt);
        Tensor strided = buf.detach().requires_grad_(), packed = buf.detach().requires_grad_();
        Tensor y1 = rotary_embedding(strided.transpose(1, 2), c, s);
        Tensor y2 = rotary_embedding(packed.transpose(1, 2).contiguous(), c, s);
        const std::string what = dev.str() + " " + dtype_name(dt) + " D=" + std::to_string(d);
        EXPECT_EQ(v64(y1), v64(y2)) << what;
        sum(mul(y1, w)).backward();
        sum(mul(y2, w)).backward();
        EXPECT_EQ(v64(strided.grad()), v64(packed.grad())) << what;
      }
}

TEST(Rotary, BadInputs) {
  Tensor c = zeros({5, 8});
  EXPECT_KILN_ERROR(rotary_embedding(zeros({1, 1, 5, 7}), zeros({5, 7}), zeros({5, 7})), "rotary_embedding", "even", "7");
  EXPECT_KILN_ERROR(rotary_embedding(zeros({1, 1, 5, 8}), c, zeros({5, 4})), "rotary_embedding", "[5, 8]", "[5, 4]");
  EXPECT_KILN_ERROR(rotary_embedding(zeros({1, 1, 6, 8}), c, c), "rotary_embedding", "broadcast");
  EXPECT_KILN_ERROR(rotary_embedding(zeros({8}), zeros({8}), zeros({8})), "rotary_embedding", "[..., T, D]");
}

// ---- cross_entropy ----

namespace {

// float64 loop reference with PyTorch semantics.
double ce_reference(const std::vector<double>& x, const std::vector<int64_t>& t, int64_t n, int64_t c,
                    const CrossEntropyOptions& o, std::vector<double>* per_row) {
  double total = 0;
  int64_t count = 0;
  for (int64_t r = 0; r < n; ++r) {
    double row = 0;
    if (t[r] != o.ignore_index) {
      double m = -INFINITY, s = 0, smooth = 0;
      for (int64_t k = 0; k < c; ++k) m = std::max(m, x[r * c + k]);
      for (int64_t k = 0; k < c; ++k) s += std::exp(x[r * c + k] - m);
      double lse = m + std::log(s);
      for (int64_t k = 0; k < c; ++k) smooth += (lse - x[r * c + k]) / c;
      row = (1 - o.label_smoothing) * (lse - x[r * c + t[r]]) + o.label_smoothing * smooth;
      ++count;
    }
    if (per_row) per_row->push_back(row);
    total += row;
  }
  if (o.reduction == Reduction::mean) return total / static_cast<double>(count);
  return total;
}

}  // namespace

TEST(CrossEntropy, MatchesLoopReference) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    for (Reduction red : {Reduction::none, Reduction::mean, Reduction::sum}) {
      for (double ls : {0.0, 0.1}) {
        for (DType tdt : {DType::i64, DType::i32}) {
          const int64_t n = 9, c = 7;
          CrossEntropyOptions o;
          o.reduction = red;
          o.label_smoothing = ls;
          o.ignore_index = 3;  // a valid class id used as ignore_index
          Tensor x = mul(randn({n, c}, gen, DType::f64, dev), 3.0);
          Tensor t = mul(rand({n}, gen, DType::f64, dev), static_cast<double>(c)).to(tdt);
          std::vector<int64_t> tv = vi(t);
          std::vector<double> rows;
          double ref = ce_reference(v64(x), tv, n, c, o, &rows);
          Tensor y = cross_entropy(x, t, o);
          if (red == Reduction::none) {
            ASSERT_EQ(y.shape(), (Shape{n}));
            auto yv = v64(y);
            for (int64_t r = 0; r < n; ++r) EXPECT_NEAR(yv[r], rows[r], 1e-12);
          } else {
            ASSERT_EQ(y.dim(), 0);
            if (std::isnan(ref)) EXPECT_TRUE(std::isnan(y.item()));
            else EXPECT_NEAR(y.item(), ref, 1e-12);
          }
        }
      }
    }
  }
}

TEST(CrossEntropy, AllIgnoredMeanIsNaN) {
  for (Device dev : test_devices()) {
    Tensor x = zeros({3, 4}, DType::f32, dev).requires_grad_();
    Tensor t = full({3}, -100, DType::i64, dev);
    Tensor y = cross_entropy(x, t);
    EXPECT_TRUE(std::isnan(y.item()));
    CrossEntropyOptions o;
    o.reduction = Reduction::sum;
    Tensor s = cross_entropy(x, t, o);
    EXPECT_EQ(s.item(), 0.0);
    s.backward();
    for (double g : v64(x.grad())) EXPECT_EQ(g, 0.0);
  }
}

// The mean's divisor with an ignore_index a double or an i32 target cannot hold (from a probe):
// one past 2^53 rounded to 2^53 and counted the ignored row (the mean over 3 rows, not 2), and
// one outside i32 with i32 targets was an error of `full` (torch ignores nothing there).
TEST(CrossEntropy, IgnoreIndexPastDoubleOrI32) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    const int64_t c = 4, big = (int64_t{1} << 53) + 1;
    Tensor x = randn({3, c}, gen, DType::f64, dev);
    CrossEntropyOptions o;
    o.ignore_index = big;
    const std::vector<int64_t> tv{1, big, 2};
    Tensor xg = x.detach().requires_grad_();
    Tensor y = cross_entropy(xg, from_vector(tv, {3}, dev), o);
    EXPECT_NEAR(y.item(), ce_reference(v64(x), tv, 3, c, o, nullptr), 1e-12);
    y.backward();
    CrossEntropyOptions small;
    small.ignore_index = -7;
    Tensor xs = x.detach().requires_grad_();
    cross_entropy(xs, from_vector(std::vector<int64_t>{1, -7, 2}, {3}, dev), small).backward();
    EXPECT_TRUE(all_close(xg.grad(), xs.grad(), {1e-12, 1e-12}, "grad with ignore_index 2^53 + 1"));
    o.ignore_index = int64_t{1} << 40;
    const std::vector<int64_t> t32{1, 0, 2};
    EXPECT_NEAR(cross_entropy(x, from_vector(std::vector<int32_t>{1, 0, 2}, {3}, dev), o).item(),
                ce_reference(v64(x), t32, 3, c, o, nullptr), 1e-12);
  }
}

TEST(CrossEntropy, Harness) {
  for (Reduction red : {Reduction::none, Reduction::mean, Reduction::sum}) {
    for (double ls : {0.0, 0.2}) {
      for (int64_t c : {1, 7, 129}) {
        CrossEntropyOptions o;
        o.reduction = red;
        o.label_smoothing = ls;
        // Targets where the mask is set, ignore_index (-100) elsewhere. Row 0 is always kept: with
        // every row ignored the mean is 0/0 = NaN (AllIgnoredMeanIsNaN covers that case), and
        // finite differences of a NaN loss cannot check the gradient.
        check_op({"cross_entropy", {{{5, c}}, idx({5}, c), bmask({5})}, [o](const std::vector<Tensor>& in) {
                    const Device dev = in[1].device();
                    Tensor first = lt(arange(0, 5, 1, DType::i64, dev), full({}, 1.0, DType::i64, dev));
                    Tensor t = where(first, in[1], where(in[2], in[1], full({}, -100.0, DType::i64, dev)));
                    return cross_entropy(in[0], t, o);
                  }, {DType::f64, DType::f32, DType::f16, DType::bf16}, true, true, c == 129 ? 4.0 : 1.0});
      }
    }
  }
}

TEST(CrossEntropy, BadInputs) {
  for (Device dev : test_devices()) {
    Tensor x = zeros({4, 10}, DType::f32, dev);
    // deferred on CUDA to the next host read (item()); immediate on CPU
    EXPECT_KILN_ERROR(cross_entropy(x, from_vector(std::vector<int64_t>{1, 2, 12, 3}, {4}, dev)).item(),
                      "cross_entropy: target[2]=12 out of range [0, 10)");
    EXPECT_KILN_ERROR(cross_entropy(x, from_vector(std::vector<int32_t>{1, -5, 2, 3}, {4}, dev)).item(), "target[1]=-5");
    EXPECT_TRUE(std::isfinite(cross_entropy(x, from_vector(std::vector<int32_t>{1, 5, 2, 3}, {4}, dev)).item()));
    EXPECT_KILN_ERROR(cross_entropy(x, zeros({3}, DType::i64, dev)), "cross_entropy", "target shape [3]", "[4, 10]");
    EXPECT_KILN_ERROR(cross_entropy(x, zeros({4}, DType::f32, dev)), "cross_entropy", "i64 or i32", "f32");
    EXPECT_KILN_ERROR(cross_entropy(zeros({4}, DType::f32, dev), zeros({4}, DType::i64, dev)), "cross_entropy", "2-D");
    CrossEntropyOptions o;
    o.label_smoothing = 1.5;
    EXPECT_KILN_ERROR(cross_entropy(x, zeros({4}, DType::i64, dev), o), "label_smoothing", "1.5");
    o = {};
    o.reduction = static_cast<Reduction>(7);  // was "div: undefined tensor argument"
    EXPECT_KILN_ERROR(cross_entropy(x, zeros({4}, DType::i64, dev), o), "cross_entropy", "reduction=7");
  }
  if (cuda_device_count() > 0) {
    Device g = cuda(0);
    EXPECT_KILN_ERROR(embedding(zeros({10, 3}), zeros({3}, DType::i64, g)), "embedding", "device mismatch", "cuda:0");
    EXPECT_KILN_ERROR(rms_norm(zeros({2, 3}), zeros({3}, DType::f32, g)), "rms_norm", "device mismatch", "cuda:0");
    EXPECT_KILN_ERROR(cross_entropy(zeros({2, 3}), zeros({2}, DType::i64, g)), "cross_entropy", "device mismatch");
    EXPECT_KILN_ERROR(rotary_embedding(zeros({1, 1, 2, 4}), zeros({2, 4}, DType::f32, g), zeros({2, 4})),
                      "rotary_embedding", "device mismatch");
  }
  EXPECT_EQ(parse_reduction("none"), Reduction::none);
  EXPECT_EQ(parse_reduction("mean"), Reduction::mean);
  EXPECT_EQ(parse_reduction("sum"), Reduction::sum);
  EXPECT_KILN_ERROR(parse_reduction("avg"), "parse_reduction", "'avg'");
}

// ---- dropout ----

TEST(Dropout, MaskScaleAndGradient) {
  KILN_TEST_GENERATOR(gen);
  for (Device dev : test_devices()) {
    const double p = 0.3;
    const int64_t n = 20000;
    Tensor x = add(rand({n}, gen, DType::f32, dev), 1.0).requires_grad_();  // no zeros in x
    Generator g1 = gen;
    Tensor y = dropout(x, p, gen);
    Tensor y2 = dropout(x.detach(), p, g1);  // same generator state: same mask
    EXPECT_TRUE(all_close(y2, y.detach(), {0, 0}, "replay"));
    Tensor go = randn({n}, gen, DType::f32, dev);
    y.backward(go);
    auto xv = v64(x), yv = v64(y), gv = v64(x.grad()), gov = v64(go);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (yv[i] == 0) {
        EXPECT_EQ(gv[i], 0.0);
      } else {
        ++kept;
        EXPECT_NEAR(yv[i], xv[i] / (1 - p), 1e-5);
        EXPECT_NEAR(gv[i], gov[i] / (1 - p), 1e-5);
      }
    }
    // Binomial(n, 0.7): standard deviation ~65; 8 sigma never fails by chance.
    EXPECT_NEAR(static_cast<double>(kept), n * (1 - p), 8 * std::sqrt(n * p * (1 - p)));
    // A second draw uses a new mask.
    Tensor y3 = dropout(x.detach(), p, gen);
    EXPECT_FALSE(all_close(y3, y.detach(), {0, 0}));
  }
}

TEST(Dropout, IdentityAndBadP) {
  Generator gen(1);
  Tensor x = ones({4});
  EXPECT_TRUE(dropout(x, 0.5, gen, false).is_same(x));
  EXPECT_TRUE(dropout(x, 0.0, gen).is_same(x));
  EXPECT_KILN_ERROR(dropout(x, 1.0, gen), "dropout", "p must be in [0, 1)", "1");
  EXPECT_KILN_ERROR(dropout(x, -0.1, gen), "dropout", "-0.1");
}

TEST(Dropout, Harness) {
  check_op({"dropout", {{{3, 7}}}, [](const std::vector<Tensor>& in) {
              Generator g(1234);  // the same mask at every call
              return dropout(in[0], 0.25, g);
            }});
}

TEST(Dropout, SameMaskOnEveryDevice) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator a(99), b(99);
  Tensor x = ones({1000});
  EXPECT_TRUE(all_close(dropout(x.to(cuda(0)), 0.5, a), dropout(x, 0.5, b), {0, 0}, "cuda vs cpu mask"));
}

// Every NN kernel, called directly with NaN-poisoned outputs, writes every output element.
TEST(NnKernels, WriteEveryElementOfPoisonedOutputs) {
  KILN_TEST_GENERATOR(gen);
  auto poisoned = [](Shape s, DType dt, Device dev) { return full(s, std::nan(""), dt, dev); };
  auto finite = [](const Tensor& t, const char* what) {
    for (double v : t.to_vector<double>())
      if (!std::isfinite(v)) return ::testing::AssertionFailure() << what << " has a non-finite element";
    return ::testing::AssertionSuccess();
  };
  for (Device dev : test_devices()) {
    for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
      SCOPED_TRACE(dtype_name(dt));
      const DType sd = dt == DType::f64 ? DType::f64 : DType::f32;
      for (auto [rows, d] : {std::pair<int64_t, int64_t>{70, 9}, {600, 16}}) {  // element by element, and in packs
        Tensor x = randn({rows, d}, gen, dt, dev), w = randn({d}, gen, dt, dev), g = randn({rows, d}, gen, dt, dev);
        Tensor ids = mul(rand({rows}, gen, DType::f64, dev), 5.0).to(DType::i64);
        Tensor y = poisoned({rows, d}, dt, dev), r = poisoned({rows}, sd, dev);
        KILN_DEVICE_CALL(dev, rms_norm_forward, y, r, x, w, 1e-6);
        EXPECT_TRUE(finite(y, "rms_norm out"));
        EXPECT_TRUE(finite(r, "rms_norm rstd"));
        Tensor dx = poisoned({rows, d}, dt, dev), dw = poisoned({d}, dt, dev);
        KILN_DEVICE_CALL(dev, rms_norm_backward, dx, dw, g, x, w, r);
        EXPECT_TRUE(finite(dx, "rms_norm dx"));
        EXPECT_TRUE(finite(dw, "rms_norm dweight"));
        Tensor e = poisoned({rows, d}, dt, dev);
        KILN_DEVICE_CALL(dev, embedding_forward, e, randn({5, d}, gen, dt, dev), ids);
        EXPECT_TRUE(finite(e, "embedding out"));
        Tensor cs = randn({7, 4}, gen, DType::f32, dev), sn = randn({7, 4}, gen, DType::f32, dev);
        Tensor xr = randn({3, 7, 4}, gen, dt, dev);
        for (bool tr : {false, true}) {
          Tensor yr = poisoned({3, 7, 4}, dt, dev);
          KILN_DEVICE_CALL(dev, rotary, yr, xr, cs, sn, tr);
          EXPECT_TRUE(finite(yr, "rotary out"));
        }
        Tensor loss = poisoned({rows}, sd, dev), lse = poisoned({rows}, sd, dev);
        Tensor tgt = where(lt(ids, full({}, 1, DType::i64, dev)), full({}, -100, DType::i64, dev), ids);
        KILN_DEVICE_CALL(dev, cross_entropy_forward, loss, lse, x, tgt, -100, 0.1);
        EXPECT_TRUE(finite(loss, "cross_entropy loss"));
        EXPECT_TRUE(finite(lse, "cross_entropy lse"));
        Tensor dl = poisoned({rows, d}, dt, dev);
        KILN_DEVICE_CALL(dev, cross_entropy_backward, dl, ones({rows}, sd, dev), x, tgt, lse, -100, 0.1);
        EXPECT_TRUE(finite(dl, "cross_entropy dlogits"));
      }
    }
    // The mask's bytes start as 7 (neither false nor true).
    Tensor raw = full({1000}, 7, DType::u8, dev);
    Tensor keep = Tensor::from_storage(raw.storage(), {1000}, {1}, 0, DType::boolean);
    KILN_DEVICE_CALL(dev, dropout_mask, keep, 3, 4, 0.5);
    auto kv = raw.to_vector<uint8_t>();
    for (uint8_t k : kv) EXPECT_LE(k, 1);
  }
}

// An embedding with no rows and some ids is an error (id 0 passed the range check and read past
// the weight).
TEST(Embedding, NoRowsIsAnError) {
  for (Device dev : test_devices()) {
    EXPECT_KILN_ERROR(embedding(zeros({0, 4}, DType::f32, dev), zeros({3}, DType::i64, dev)), "embedding",
                      "weight has no rows");
    EXPECT_EQ(embedding(zeros({0, 4}, DType::f32, dev), zeros({0}, DType::i64, dev)).numel(), 0);
  }
}
