// The fast CUDA RMSNorm kernels (kernels/cuda/rmsnorm.h) against a float64 reference: forward
// (out, rstd), backward (dx, dweight, with and without the extra input gradient) and the forward
// fused with the residual add, in f32 / bf16 / f16 on odd shapes (one row, odd row counts, every
// vectors-per-thread configuration, the longest row); the backward against central finite
// differences of the f64 reference loss; outputs poisoned first; bits equal run to run;
// shapes the kernels decline say so (and leave the outputs alone). Skipped without a GPU.
#include <cmath>

#include "kiln/core/rng.h"
#include "kiln/kernels/cuda/rmsnorm.h"
#include "tests/cuda/cuda_test_util.h"

using namespace kiln;
using namespace kiln::test;
namespace rn = kiln::kernels::cuda::rmsnorm;

namespace {

constexpr double kEps = 1e-5;

// f64 reference on row-major values: y = x·rstd·w; rstd; dx; dw for the loss Σ y·g.
struct Ref {
  std::vector<double> y, rstd, dx, dw;
};
Ref reference(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& g, int64_t rows,
              int64_t d) {
  Ref r;
  r.y.resize(rows * d), r.rstd.resize(rows), r.dx.resize(rows * d), r.dw.assign(d, 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0, dot = 0;
    for (int64_t c = 0; c < d; ++c) ss += x[i * d + c] * x[i * d + c];
    const double rs = 1.0 / std::sqrt(ss / d + kEps);
    r.rstd[i] = rs;
    for (int64_t c = 0; c < d; ++c) {
      r.y[i * d + c] = x[i * d + c] * rs * w[c];
      dot += g[i * d + c] * w[c] * x[i * d + c];
      r.dw[c] += g[i * d + c] * x[i * d + c] * rs;
    }
    for (int64_t c = 0; c < d; ++c) r.dx[i * d + c] = g[i * d + c] * w[c] * rs - x[i * d + c] * rs * rs * rs * dot / d;
  }
  return r;
}

std::vector<double> values(const Tensor& t) { return t.to(kCPU).to(DType::f64).contiguous().to_vector<double>(); }

double tol(DType t) { return t == DType::bf16 ? 1.6e-2 : t == DType::f16 ? 2e-3 : 2e-5; }

struct Inputs {
  Tensor x, w, g;  // CPU, in the dtype
  std::vector<double> xv, wv, gv;
};
Inputs inputs(Generator& gen, int64_t rows, int64_t d, DType dt) {
  Inputs in;
  in.x = randn({rows, d}, gen, DType::f64).to(dt);
  in.w = add(mul(randn({d}, gen, DType::f64), 0.5), 1.0).to(dt);
  in.g = randn({rows, d}, gen, DType::f64).to(dt);
  in.xv = values(in.x), in.wv = values(in.w), in.gv = values(in.g);
  return in;
}

// Every vectors-per-thread configuration: 16-byte vectors per row of 1..64 (1), ≤ 512 (2),
// ≤ 1024 / 2048 (4 / 8 in the backward); rows 1, odd, and more than a grid of blocks.
std::vector<std::pair<int64_t, int64_t>> shapes(DType dt) {
  const int64_t v = 16 / static_cast<int64_t>(itemsize(dt));
  return {{1, v}, {3, 8 * v}, {7, 64 * v}, {129, 65 * v}, {5, 513 * v}, {1000, 96 * v}, {33, 1025 * v}, {3, 2048 * v}};
}

}  // namespace

TEST(RmsNormFast, ForwardAndBackwardMatchFloat64) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(340);
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (auto [rows, d] : shapes(dt)) {
      const std::string what = std::string(dtype_name(dt)) + " [" + std::to_string(rows) + ", " + std::to_string(d) + "]";
      ASSERT_TRUE(rn::applies(dt, d)) << what;
      Inputs in = inputs(gen, rows, d, dt);
      const Ref ref = reference(in.xv, in.wv, in.gv, rows, d);
      Tensor x = in.x.to(gpu()), w = in.w.to(gpu()), g = in.g.to(gpu());
      Tensor y = full({rows, d}, NAN, dt, gpu()), rstd = full({rows}, NAN, DType::f32, gpu());
      ASSERT_TRUE(rn::forward(y, rstd, x, w, kEps)) << what;
      EXPECT_TRUE(all_close(y, ref.y, finite_only({tol(dt), tol(dt)}), "y " + what));
      EXPECT_TRUE(all_close(rstd, ref.rstd, finite_only({1e-6, 1e-5}), "rstd " + what));
      Tensor dx = full({rows, d}, NAN, dt, gpu()), dw = full({d}, NAN, dt, gpu());
      ASSERT_TRUE(rn::backward(dx, dw, g, x, w, rstd)) << what;
      // dx and dw scale with the row's terms: tolerances of a sum of d (dx) or rows (dw) terms.
      EXPECT_TRUE(all_close(dx, ref.dx, finite_only({4 * tol(dt), tol(dt)}), "dx " + what));
      EXPECT_TRUE(all_close(dw, ref.dw,
                            finite_only({tol(dt) * std::max(1.0, std::sqrt(static_cast<double>(rows))), tol(dt)}),
                            "dw " + what));
      // With the extra input gradient (the residual stream's): dx + extra.
      Tensor extra = randn({rows, d}, gen, DType::f64).to(dt);
      std::vector<double> want = ref.dx;
      const std::vector<double> ev = values(extra);
      for (size_t i = 0; i < want.size(); ++i) want[i] += ev[i];
      Tensor dx2 = full({rows, d}, NAN, dt, gpu());
      ASSERT_TRUE(rn::backward(dx2, Tensor(), g, x, w, rstd, extra.to(gpu()))) << what;
      EXPECT_TRUE(all_close(dx2, want, finite_only({4 * tol(dt), tol(dt)}), "dx + extra " + what));
    }
}

TEST(RmsNormFast, BackwardMatchesFiniteDifferences) {
  KILN_SKIP_WITHOUT_CUDA();
  // f32 on the GPU against central differences of the f64 loss L = Σ y·g (step 1e-4): checks
  // the analytic formula the kernels compute, not just agreement with the same formula.
  Generator gen(341);
  const int64_t rows = 3, d = 36;
  Inputs in = inputs(gen, rows, d, DType::f32);
  Tensor x = in.x.to(gpu()), w = in.w.to(gpu()), g = in.g.to(gpu());
  Tensor y = zeros({rows, d}, DType::f32, gpu()), rstd = zeros({rows}, DType::f32, gpu());
  ASSERT_TRUE(rn::forward(y, rstd, x, w, kEps));
  Tensor dx = zeros({rows, d}, DType::f32, gpu()), dw = zeros({d}, DType::f32, gpu());
  ASSERT_TRUE(rn::backward(dx, dw, g, x, w, rstd));
  const std::vector<double> gdx = values(dx), gdw = values(dw);
  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    const Ref r = reference(xv, wv, in.gv, rows, d);
    double l = 0;
    for (size_t i = 0; i < r.y.size(); ++i) l += r.y[i] * in.gv[i];
    return l;
  };
  const double h = 1e-4;
  for (int64_t i = 0; i < rows * d; ++i) {
    std::vector<double> xp = in.xv, xm = in.xv;
    xp[i] += h, xm[i] -= h;
    const double fd = (loss(xp, in.wv) - loss(xm, in.wv)) / (2 * h);
    EXPECT_NEAR(gdx[i], fd, 1e-3 * (1 + std::fabs(fd))) << "dx[" << i << "]";
  }
  for (int64_t c = 0; c < d; ++c) {
    std::vector<double> wp = in.wv, wm = in.wv;
    wp[c] += h, wm[c] -= h;
    const double fd = (loss(in.xv, wp) - loss(in.xv, wm)) / (2 * h);
    EXPECT_NEAR(gdw[c], fd, 1e-3 * (1 + std::fabs(fd))) << "dw[" << c << "]";
  }
}

TEST(RmsNormFast, ResidualAddForwardMatchesFloat64) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(342);
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (auto [rows, d] : shapes(dt)) {
      const std::string what = std::string(dtype_name(dt)) + " [" + std::to_string(rows) + ", " + std::to_string(d) + "]";
      Tensor x = randn({rows, d}, gen, DType::f64).to(dt), res = randn({rows, d}, gen, DType::f64).to(dt);
      Tensor w = add(mul(randn({d}, gen, DType::f64), 0.5), 1.0).to(dt);
      // h as stored: the sum rounded once to the dtype; the norm of that h.
      Tensor hsum = add(x.to(DType::f64), res.to(DType::f64)).to(dt);
      const std::vector<double> hv = values(hsum), wv = values(w);
      const Ref ref = reference(hv, wv, std::vector<double>(rows * d, 0.0), rows, d);
      Tensor h = full({rows, d}, NAN, dt, gpu()), y = full({rows, d}, NAN, dt, gpu());
      Tensor rstd = full({rows}, NAN, DType::f32, gpu());
      rn::add_forward(h, y, rstd, x.to(gpu()), res.to(gpu()), w.to(gpu()), kEps);
      EXPECT_TRUE(all_close(h, hv, finite_only({0, tol(dt) / 4}), "h " + what));
      EXPECT_TRUE(all_close(y, ref.y, finite_only({tol(dt), tol(dt)}), "y " + what));
      EXPECT_TRUE(all_close(rstd, ref.rstd, finite_only({1e-6, 1e-5}), "rstd " + what));
    }
}

TEST(RmsNormFast, BitsEqualRunToRun) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(343);
  for (DType dt : {DType::f32, DType::bf16}) {
    const int64_t rows = 4099, d = 2048;
    Inputs in = inputs(gen, rows, d, dt);
    Tensor x = in.x.to(gpu()), w = in.w.to(gpu()), g = in.g.to(gpu());
    Tensor out[2], dxs[2], dws[2];
    for (int run = 0; run < 2; ++run) {
      Tensor y = zeros({rows, d}, dt, gpu()), rstd = zeros({rows}, DType::f32, gpu());
      ASSERT_TRUE(rn::forward(y, rstd, x, w, kEps));
      Tensor dx = zeros({rows, d}, dt, gpu()), dw = zeros({d}, dt, gpu());
      ASSERT_TRUE(rn::backward(dx, dw, g, x, w, rstd));
      out[run] = y, dxs[run] = dx, dws[run] = dw;
    }
    EXPECT_TRUE(same_bits(out[1], out[0], "y"));
    EXPECT_TRUE(same_bits(dxs[1], dxs[0], "dx"));
    EXPECT_TRUE(same_bits(dws[1], dws[0], "dw"));
  }
}

TEST(RmsNormFast, ShapesTheKernelsDeclineAreLeftToTheGeneralPath) {
  KILN_SKIP_WITHOUT_CUDA();
  EXPECT_FALSE(rn::applies(DType::f64, 64));
  EXPECT_FALSE(rn::applies(DType::bf16, 7));      // 14 bytes a row: not whole vectors
  EXPECT_FALSE(rn::applies(DType::bf16, 16392));  // more than 2048 vectors
  EXPECT_TRUE(rn::applies(DType::bf16, 16384));
  Tensor x = zeros({4, 7}, DType::bf16, gpu()), w = zeros({7}, DType::bf16, gpu());
  Tensor y = full({4, 7}, 3.0, DType::bf16, gpu()), rstd = zeros({4}, DType::f32, gpu());
  EXPECT_FALSE(rn::forward(y, rstd, x, w, kEps));
  EXPECT_TRUE(same_bits(y, full({4, 7}, 3.0, DType::bf16), "declined: out untouched"));
  Tensor x8 = zeros({4, 16}, DType::bf16, gpu()).narrow(1, 0, 8);  // not contiguous
  EXPECT_FALSE(rn::forward(zeros({4, 8}, DType::bf16, gpu()), rstd, x8, zeros({8}, DType::bf16, gpu()), kEps));
  try {
    rn::add_forward(y, y, rstd, x, x, w, kEps);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rms_norm_add: rows of 7 bf16 elements"), std::string::npos) << e.what();
  }
}
