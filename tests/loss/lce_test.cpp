// Tests of the fused linear + cross-entropy (kiln/loss/): loss, lse and every gradient vs the
// float64 composed reference for each option alone and all combined, in f32, bf16 (judged as
// Cut Cross-Entropy does: |truth − kiln| ≤ |truth − same-dtype reference| + tol) and f64;
// finite differences; odd shapes and chunk boundaries; ignored targets; tied weights;
// micro-batches with num_items; determinism bits; the module; bad input errors.
// Each test runs on the CPU and, when a GPU is present, on CUDA (skipped otherwise), and once
// more on CUDA with kiln's Hopper GEMM for the loss's products (KilnGemm: sm_90 only), the
// process default backend set to kiln for the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/profile.h"
#include "kiln/loss/linear_cross_entropy.h"
#include "kiln/loss/module.h"
#include "kiln/ops/ops.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/expect.h"

using namespace kiln;

namespace {

struct Inputs {
  Tensor hidden, weight, bias, cweight, target;  // CPU, f64 (target i64)
};

// Fresh random inputs: logits of order a few units, `ignore_frac` of targets ignored.
Inputs make_inputs(uint64_t seed, Shape hshape, int64_t v, double ignore_frac, int64_t ignore_index = -100) {
  Generator gen(seed);
  Inputs in;
  const int64_t d = hshape.back();
  in.hidden = randn(hshape, gen, DType::f64);
  in.weight = mul(randn({v, d}, gen, DType::f64), 1.5 / std::sqrt(static_cast<double>(d)));
  in.bias = mul(randn({v}, gen, DType::f64), 0.5);
  in.cweight = add(rand({v}, gen, DType::f64), 0.5);
  Shape tshape(hshape.begin(), hshape.end() - 1);
  const int64_t n = shape_numel(tshape);
  std::vector<double> u = rand({n}, gen, DType::f64).to_vector<double>();
  std::vector<double> w = rand({n}, gen, DType::f64).to_vector<double>();
  std::vector<int64_t> t(static_cast<size_t>(n));
  for (size_t i = 0; i < t.size(); ++i)
    t[i] = w[i] < ignore_frac ? ignore_index : std::min<int64_t>(v - 1, static_cast<int64_t>(u[i] * v));
  in.target = from_vector<int64_t>(t, tshape);
  return in;
}

struct Outcome {
  Tensor loss, zloss, lse, gh, gw, gb;  // CPU, f64
};

enum class Impl { fused, reference };

// Runs one implementation in `dtype` on `dev`; backward with grad_output (random for none).
Outcome run(Impl impl, const Inputs& in, LinearCrossEntropyOptions o, bool use_bias, bool use_cw, DType dtype,
            Device dev, uint64_t seed = 7) {
  Tensor h = in.hidden.to(dtype).to(dev).detach().requires_grad_();
  Tensor w = in.weight.to(dtype).to(dev).detach().requires_grad_();
  Tensor b;
  if (use_bias) {
    b = in.bias.to(dtype).to(dev).detach().requires_grad_();
    o.bias = b;
  }
  if (use_cw) o.weight = in.cweight.to(dtype).to(dev);
  o.return_lse = true;
  Tensor tg = in.target.to(dev);
  LinearCrossEntropyResult r = impl == Impl::fused ? linear_cross_entropy(h, w, tg, o)
                                                    : linear_cross_entropy_reference(h, w, tg, o);
  Tensor go;
  if (o.reduction == Reduction::none) {
    Generator gen(seed);
    go = randn(r.loss.shape(), gen, DType::f64).to(dtype).to(dev);
  } else {
    go = full({}, 0.75, dtype, dev);  // not 1, so that the scaling by grad_output is tested
  }
  r.loss.backward(go);
  Outcome out;
  out.loss = r.loss.detach().to(kCPU).to(DType::f64);
  out.zloss = r.z_loss.to(kCPU).to(DType::f64);
  out.lse = r.lse.to(kCPU).to(DType::f64);
  out.gh = h.grad().to(kCPU).to(DType::f64);
  out.gw = w.grad().to(kCPU).to(DType::f64);
  if (use_bias) out.gb = b.grad().to(kCPU).to(DType::f64);
  return out;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : t.to_vector<double>()) m = std::max(m, std::abs(x));
  return m;
}
double max_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) != std::isnan(vb[i])) return INFINITY;
    if (!std::isnan(va[i])) m = std::max(m, std::abs(va[i] - vb[i]));
  }
  return m;
}

// Within a bound on every element: f64 / f32 1e-10 / 2e-5 of the truth's scale (its largest
// magnitude); bf16 the same-dtype reference's largest error + 1e-2 of that scale.
void expect_near_truth(const char* what, const Tensor& truth, const Tensor& got, const Tensor& same_dtype_ref,
                       DType dtype) {
  if (!truth.defined()) return;
  const double scale = std::max(max_abs(truth), 1e-30);
  const double atol = dtype == DType::f64   ? 1e-10 * scale + 1e-300
                      : dtype == DType::f32 ? 2e-5 * scale
                                            : max_diff(truth, same_dtype_ref) + 1e-2 * scale;
  EXPECT_TRUE(test::all_close(got, truth, {atol, 0}, what)) << "scale " << scale;
}

struct Case {
  const char* name;
  std::function<void(LinearCrossEntropyOptions&)> set;
  bool bias = false, cw = false;
  double ignore_frac = 0.0;
};

std::vector<Case> option_cases() {
  return {
      {"default", [](auto&) {}},
      {"ignore_index", [](auto& o) { o.ignore_index = 3; }, false, false, 0.2},
      {"sum", [](auto& o) { o.reduction = Reduction::sum; }},
      {"none", [](auto& o) { o.reduction = Reduction::none; }, false, false, 0.2},
      {"label_smoothing", [](auto& o) { o.label_smoothing = 0.1; }},
      {"z_loss", [](auto& o) { o.z_loss = 0.05; }},
      {"softcap", [](auto& o) { o.softcap = 2.0; }},
      {"class_weight", [](auto&) {}, false, true, 0.2},
      {"bias", [](auto&) {}, true, false},
      {"num_items", [](auto& o) { o.num_items = 37.5; }},
      {"weight_grad_f32", [](auto& o) { o.weight_grad_f32 = true; }},  // CUDA: f32 dW accumulator
      {"all_combined",
       [](auto& o) {
         o.label_smoothing = 0.1;
         o.z_loss = 0.05;
         o.softcap = 2.5;
         o.num_items = 23.0;
       },
       true, true, 0.2},
      {"all_combined_none",
       [](auto& o) {
         o.reduction = Reduction::none;
         o.label_smoothing = 0.2;
         o.z_loss = 0.01;
         o.softcap = 3.0;
       },
       true, true, 0.2},
  };
}

// Where a case runs: the device, and on CUDA whether the loss's products take kiln's GEMM.
struct LceTarget {
  Device dev;
  bool kiln_gemm = false;
};

class Lce : public ::testing::TestWithParam<LceTarget> {
 protected:
  void SetUp() override {
    if (GetParam().dev.is_cuda() && cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    if (GetParam().kiln_gemm) {
      if (!test::kiln_gemm_available()) GTEST_SKIP() << "kiln's GEMM kernel needs an sm_90 GPU";
      kernels::gemm::set_default_backend(kernels::gemm::Backend::kiln);
    }
  }
  void TearDown() override { kernels::gemm::clear_default_backend(); }
  Device dev() const { return GetParam().dev; }
  bool kiln_gemm() const { return GetParam().kiln_gemm; }

  // Compares fused (dtype, device) with the f64 truth for one case.
  void check_case(const Case& c, Shape hshape, int64_t v, DType dtype, int64_t chunk, uint64_t seed) {
    SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype) + " hidden " + shape_str(hshape) + " V=" +
                 std::to_string(v) + " chunk=" + std::to_string(chunk));
    LinearCrossEntropyOptions o;
    c.set(o);
    o.chunk_tokens = chunk;
    Inputs in = make_inputs(seed, hshape, v, c.ignore_frac, o.ignore_index);
    Outcome truth = run(Impl::reference, in, o, c.bias, c.cw, DType::f64, kCPU);
    Outcome got = run(Impl::fused, in, o, c.bias, c.cw, dtype, dev());
    Outcome ref;
    if (dtype == DType::bf16 || dtype == DType::f16) ref = run(Impl::reference, in, o, c.bias, c.cw, dtype, kCPU);
    expect_near_truth("loss", truth.loss, got.loss, ref.loss, dtype);
    expect_near_truth("z_loss", truth.zloss, got.zloss, ref.zloss, dtype);
    expect_near_truth("lse", truth.lse, got.lse, ref.lse, dtype);
    expect_near_truth("grad hidden", truth.gh, got.gh, ref.gh, dtype);
    expect_near_truth("grad weight", truth.gw, got.gw, ref.gw, dtype);
    expect_near_truth("grad bias", truth.gb, got.gb, ref.gb, dtype);
  }
};

TEST_P(Lce, EachOptionAloneAndCombinedF32) {
  uint64_t seed = 100;
  for (const Case& c : option_cases()) check_case(c, {48, 32}, 1000, DType::f32, 16, ++seed);
}

TEST_P(Lce, EachOptionAloneAndCombinedBF16) {
  uint64_t seed = 200;
  for (const Case& c : option_cases()) check_case(c, {48, 32}, 1000, DType::bf16, 16, ++seed);
}

TEST_P(Lce, EachOptionAloneAndCombinedF64) {
  if (dev().is_cuda()) GTEST_SKIP() << "the CUDA kernel takes 16-bit and f32 inputs";
  uint64_t seed = 300;
  for (const Case& c : option_cases()) check_case(c, {20, 8}, 97, DType::f64, 6, ++seed);
}

TEST_P(Lce, OddShapesAndChunkBoundaries) {
  const std::vector<Case> cs = option_cases();
  const Case& all = cs[cs.size() - 2];
  uint64_t seed = 400;
  for (int64_t n : {1, 7, 257})
    for (int64_t v : {1, 129, 1000})
      for (int64_t chunk : {0, 3, 64}) check_case(all, {n, 24}, v, DType::f32, chunk, ++seed);
  check_case(all, {1, 1}, 7, DType::f32, 0, ++seed);
}

// The CUDA d_hidden product split over slices of V (f32 partials summed in order): forced
// splits with a V that no split divides (a tail slice) and N not a multiple of the chunk, and
// the automatic choice at a V long enough to split.
TEST_P(Lce, SplitHiddenGradientOverVocabulary) {
  if (!dev().is_cuda()) GTEST_SKIP() << "dh_split is a CUDA option (the CPU kernel ignores it)";
  const std::vector<Case> cs = option_cases();
  const Case& all = cs[cs.size() - 2];
  uint64_t seed = 450;
  for (int64_t split : {2, 3, 7}) {
    Case c = all;
    c.set = [&all, split](LinearCrossEntropyOptions& o) {
      all.set(o);
      o.dh_split = split;
    };
    check_case(c, {257, 24}, 1003, DType::f32, 64, ++seed);
    check_case(c, {70, 24}, 1003, DType::bf16, 32, ++seed);
  }
  Case auto_split{"auto_split", [](auto&) {}};
  check_case(auto_split, {130, 16}, 8195, DType::f32, 0, ++seed);
}

// The profile (CUDA) reports the chunking it used, within the 256 MiB budget, and phase times.
TEST_P(Lce, ProfileReportsChunkingAndPhases) {
  Inputs in = make_inputs(470, {300, 40}, 5000, 0.1);
  Tensor h = in.hidden.to(DType::bf16).to(dev()).requires_grad_();
  Tensor w = in.weight.to(DType::bf16).to(dev()).requires_grad_();
  kernels::LceProfile prof;
  LinearCrossEntropyOptions o;
  o.profile = &prof;
  o.chunk_tokens = 64;
  o.dh_split = 3;
  linear_cross_entropy(h, w, in.target.to(dev()), o).loss.backward();
  if (!dev().is_cuda()) {
    EXPECT_EQ(prof.chunks, 0);  // the CPU body does not profile
    return;
  }
  EXPECT_EQ(prof.chunks, 5);
  EXPECT_EQ(prof.chunk_tokens, 64);
  EXPECT_EQ(prof.dh_split, 3);
  for (double ms : {prof.logits_ms, prof.rows_ms, prof.dh_ms, prof.dh_reduce_ms, prof.dw_ms}) EXPECT_GT(ms, 0.0);
  EXPECT_FALSE(prof.logits_algo.empty());
  kernels::LceProfile auto_prof;
  o.chunk_tokens = 0;
  o.dh_split = 0;
  o.profile = &auto_prof;
  h.set_grad(Tensor());
  linear_cross_entropy(h, w, in.target.to(dev()), o).loss.backward();
  EXPECT_EQ(auto_prof.chunks, 1);  // 300 tokens of V = 5000 fit one chunk
  EXPECT_EQ(auto_prof.chunk_tokens, 300);
  EXPECT_EQ(auto_prof.dh_split, 1);  // unsplit by default
  EXPECT_LE(auto_prof.extra_bytes, int64_t{256} << 20);
}

// On kiln's GEMM (CUDA, 16-bit): the profile names kiln's kernel for each product (the logits
// with their per-tile log-sum-exp where nothing else needs pass 1, d_weight by its residual
// epilogue over a 16-bit gradient, by accumulate into an f32 one), the chunk holds the
// log-sum-exps besides its logits, and the loss and gradients equal cuBLASLt's path within
// rounding (one chunk boundary, a partial last chunk, V not a multiple of the GEMM's tile).
TEST_P(Lce, KilnGemmRunsEachProduct) {
  if (!kiln_gemm()) GTEST_SKIP() << "the kiln GEMM path (CUDA, sm_90)";
  Inputs in = make_inputs(480, {200, 64}, 1003, 0.1);
  for (bool f32_dw : {false, true}) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(std::string(f32_dw ? "f32 dW" : "bf16 dW") + (bias ? " bias" : ""));
      kernels::LceProfile prof;
      LinearCrossEntropyOptions o;
      o.chunk_tokens = 128;
      o.weight_grad_f32 = f32_dw;
      o.profile = &prof;
      Outcome k = run(Impl::fused, in, o, bias, false, DType::bf16, dev());
      EXPECT_EQ(prof.logits_algo, bias ? "kiln sm90 none" : "kiln sm90 row_lse");
      EXPECT_EQ(prof.dh_algo, "kiln sm90 none");
      EXPECT_EQ(prof.dw_algo, f32_dw ? "kiln sm90 accumulate" : "kiln sm90 residual");
      EXPECT_EQ(prof.extra_bytes, 128 * 1008 * 2 + (bias ? 0 : 128 * kernels::gemm::row_stat_tiles(1003) * 4));
      o.gemm_backend = kernels::gemm::Backend::cublaslt;
      o.profile = nullptr;
      Outcome c = run(Impl::fused, in, o, bias, false, DType::bf16, dev());
      EXPECT_LE(max_diff(k.loss, c.loss), 1e-3 * std::max(max_abs(c.loss), 1.0));
      EXPECT_LE(max_diff(k.lse, c.lse), 3e-2);  // f32 accumulators against bf16-rounded logits
      for (auto [x, y] : {std::pair{k.gh, c.gh}, {k.gw, c.gw}, {k.gb, c.gb}})
        if (y.defined()) {
          EXPECT_LE(max_diff(x, y), 2e-2 * max_abs(y));
        }
    }
  }
}

// The gradient filter on kiln's GEMM skips dz's all-zero 64 × 64 blocks in the d_hidden and
// d_weight products. Inputs as a trained model's are where it pays: a peaked softmax whose mass
// sits on a few frequent classes (here 64, one column block; the targets among them), every other
// class far below eps. Small integers throughout (hidden in {-1, 0, 1} with a constant first
// feature, weights in {-1, 0, 1} and 16..19 on that feature for the frequent classes), so the
// logits are exact in bf16 and in any f32 summation order: kiln's and cuBLASLt's products store
// the same logits bit for bit. The profile counts the blocks (most zero); the loss and gradients
// equal the filter's on cuBLASLt (every block multiplied, the dropped entries zero) within the
// products' rounding, so no block holding a kept entry was skipped.
TEST_P(Lce, KilnGemmFilterSkipsZeroBlocks) {
  if (!kiln_gemm()) GTEST_SKIP() << "the kiln GEMM path (CUDA, sm_90)";
  const int64_t n = 192, d = 64, v = 32000, frequent = 64;
  Generator gen(490);
  auto ternary = [&](Shape s, double p_zero) {  // entries in {-1, 0, 1}, 0 with probability p_zero
    std::vector<double> u = rand(s, gen, DType::f64).to_vector<double>(), w = rand(s, gen, DType::f64).to_vector<double>();
    for (size_t i = 0; i < u.size(); ++i) u[i] = u[i] < p_zero ? 0.0 : (w[i] < 0.5 ? -1.0 : 1.0);
    return u;
  };
  std::vector<double> hv = ternary({n, d}, 0.8), wv = ternary({v, d}, 0.8);
  for (int64_t i = 0; i < n; ++i) hv[i * d] = 1.0;  // the constant feature
  for (int64_t j = 0; j < v; ++j) wv[j * d] = j < frequent ? 16.0 + static_cast<double>(j % 4) : 0.0;
  Inputs in;
  in.hidden = from_vector<double>(hv, {n, d});
  in.weight = from_vector<double>(wv, {v, d});
  std::vector<double> u = rand({n}, gen, DType::f64).to_vector<double>();
  std::vector<int64_t> tv(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tv[i] = i % 10 == 9 ? -100 : std::min<int64_t>(frequent - 1, static_cast<int64_t>(u[i] * frequent));
  in.target = from_vector<int64_t>(tv, {n});
  for (bool f32_dw : {false, true}) {
    SCOPED_TRACE(f32_dw ? "f32 dW" : "bf16 dW");
    kernels::LceProfile prof;
    LinearCrossEntropyOptions o;
    o.chunk_tokens = 128;  // a full chunk and a partial one (64 rows)
    o.filter_eps = std::ldexp(1.0, -12);
    o.weight_grad_f32 = f32_dw;
    o.profile = &prof;
    Outcome k = run(Impl::fused, in, o, false, false, DType::bf16, dev());
    EXPECT_EQ(prof.sparse_blocks, (2 + 1) * kernels::gemm::sparse_blocks(v));
    EXPECT_GT(prof.sparse_zero_blocks, prof.sparse_blocks * 9 / 10) << "the filter left few zero blocks";
    EXPECT_LT(prof.sparse_zero_blocks, prof.sparse_blocks);
    o.gemm_backend = kernels::gemm::Backend::cublaslt;
    o.profile = nullptr;
    Outcome c = run(Impl::fused, in, o, false, false, DType::bf16, dev());
    EXPECT_LE(max_diff(k.loss, c.loss), 1e-3 * std::max(max_abs(c.loss), 1.0));
    EXPECT_LE(max_diff(k.gh, c.gh), 2e-2 * max_abs(c.gh));
    EXPECT_LE(max_diff(k.gw, c.gw), 2e-2 * max_abs(c.gw));
  }
  // Without the filter nothing is flagged or counted.
  kernels::LceProfile prof;
  LinearCrossEntropyOptions o;
  o.profile = &prof;
  run(Impl::fused, in, o, false, false, DType::bf16, dev());
  EXPECT_EQ(prof.sparse_blocks, 0);
}

TEST_P(Lce, BatchedNonContiguousHidden) {
  // hidden [B, T, d] as a transposed view of a [T, B, d] leaf; target [B, T].
  Inputs in = make_inputs(500, {3, 5, 16}, 300, 0.2);
  Tensor base = in.hidden.transpose(0, 1).contiguous().to(DType::f32).to(dev()).requires_grad_();
  Tensor h = base.transpose(0, 1);
  ASSERT_FALSE(h.is_contiguous());
  Tensor w = in.weight.to(DType::f32).to(dev());
  LinearCrossEntropyOptions o;
  o.chunk_tokens = 4;
  LinearCrossEntropyResult r = linear_cross_entropy(h, w, in.target.to(dev()), o);
  r.loss.backward();
  Tensor b64 = in.hidden.transpose(0, 1).contiguous().requires_grad_();
  LinearCrossEntropyResult t = linear_cross_entropy_reference(b64.transpose(0, 1), in.weight, in.target, o);
  t.loss.backward();
  EXPECT_NEAR(r.loss.item(), t.loss.item(), 1e-5 * std::abs(t.loss.item()));
  Tensor g = base.grad().to(kCPU).to(DType::f64);
  EXPECT_EQ(g.shape(), (Shape{5, 3, 16}));
  EXPECT_LE(max_diff(g, b64.grad()), 2e-5 * max_abs(b64.grad()));
}

TEST_P(Lce, FiniteDifferencesF64) {
  if (dev().is_cuda()) GTEST_SKIP() << "f64 runs on the CPU kernel only";
  Inputs in = make_inputs(600, {5, 4}, 11, 0.2);
  LinearCrossEntropyOptions o;
  o.label_smoothing = 0.15;
  o.z_loss = 0.1;
  o.softcap = 1.5;
  o.weight = in.cweight;
  o.chunk_tokens = 2;
  auto loss_at = [&](const Tensor& h, const Tensor& w, const Tensor& b) {
    LinearCrossEntropyOptions oo = o;
    oo.bias = b;
    return linear_cross_entropy(h, w, in.target, oo).loss.item();
  };
  Tensor h = in.hidden.clone().requires_grad_(), w = in.weight.clone().requires_grad_(),
         b = in.bias.clone().requires_grad_();
  LinearCrossEntropyOptions ob = o;
  ob.bias = b;
  linear_cross_entropy(h, w, in.target, ob).loss.backward();
  const double step = 1e-6;
  for (int which = 0; which < 3; ++which) {
    Tensor& x = which == 0 ? h : which == 1 ? w : b;
    std::vector<double> g = x.grad().to_vector<double>();
    for (int64_t i = 0; i < x.numel(); i += 3) {
      Tensor xp = x.detach().clone(), xm = x.detach().clone();
      Tensor fp = xp.reshape({-1}), fm = xm.reshape({-1});
      fp.narrow(0, i, 1).fill_(fp.narrow(0, i, 1).item() + step);
      fm.narrow(0, i, 1).fill_(fm.narrow(0, i, 1).item() - step);
      double lp = which == 0 ? loss_at(xp, w.detach(), b.detach())
                  : which == 1 ? loss_at(h.detach(), xp, b.detach()) : loss_at(h.detach(), w.detach(), xp);
      double lm = which == 0 ? loss_at(xm, w.detach(), b.detach())
                  : which == 1 ? loss_at(h.detach(), xm, b.detach()) : loss_at(h.detach(), w.detach(), xm);
      EXPECT_NEAR(g[static_cast<size_t>(i)], (lp - lm) / (2 * step), 1e-7) << "input " << which << " element " << i;
    }
  }
}

TEST_P(Lce, AllTargetsIgnored) {
  Inputs in = make_inputs(700, {9, 8}, 50, 1.0);
  for (Reduction red : {Reduction::mean, Reduction::sum}) {
    Tensor h = in.hidden.to(DType::f32).to(dev()).requires_grad_();
    Tensor w = in.weight.to(DType::f32).to(dev()).requires_grad_();
    LinearCrossEntropyOptions o;
    o.reduction = red;
    LinearCrossEntropyResult r = linear_cross_entropy(h, w, in.target.to(dev()), o);
    if (red == Reduction::mean) EXPECT_TRUE(std::isnan(r.loss.item()));
    else EXPECT_EQ(r.loss.item(), 0.0);
    r.loss.backward();
    EXPECT_EQ(max_abs(h.grad().to(kCPU).to(DType::f64)), 0.0);
    EXPECT_EQ(max_abs(w.grad().to(kCPU).to(DType::f64)), 0.0);
  }
}

TEST_P(Lce, TiedWeightAccumulatesWithEmbeddingGradient) {
  // The weight is used as the embedding (one-hot · W) and as the output projection.
  const int64_t n = 12, d = 16, v = 40;
  Inputs in = make_inputs(800, {n, d}, v, 0.1);
  std::vector<int64_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = (i * 7) % v;
  Tensor idt = from_vector<int64_t>(ids, {n});
  Tensor onehot = eq(arange(v).view({1, v}), idt.view({n, 1})).to(DType::f64);
  auto run_tied = [&](bool fused, DType dt, Device dv) {
    Tensor w = in.weight.to(dt).to(dv).detach().requires_grad_();
    nn::LinearCrossEntropyLoss head(w, LinearCrossEntropyOptions{});
    head.options().chunk_tokens = 5;
    EXPECT_FALSE(head.owns_weight());
    Tensor hidden = tanh(matmul(onehot.to(dt).to(dv), w));
    Tensor loss = fused ? head(hidden, in.target.to(dv)).loss
                        : linear_cross_entropy_reference(hidden, w, in.target.to(dv), head.options()).loss;
    loss.backward();
    EXPECT_TRUE(head.weight().grad().defined());
    return w.grad().to(kCPU).to(DType::f64);
  };
  Tensor truth = run_tied(false, DType::f64, kCPU);
  Tensor got = run_tied(true, DType::f32, dev());
  EXPECT_LE(max_diff(truth, got), 2e-5 * max_abs(truth));
}

TEST_P(Lce, MicroBatchesWithNumItemsEqualOneBatch) {
  const int64_t n = 64, d = 16, v = 200;
  Inputs in = make_inputs(900, {n, d}, v, 0.25);
  int64_t count = 0;
  for (int64_t t : in.target.to_vector<int64_t>()) count += t != -100;
  Tensor h = in.hidden.to(DType::f32).to(dev()).requires_grad_();
  Tensor w1 = in.weight.to(DType::f32).to(dev()).requires_grad_();
  Tensor tg = in.target.to(dev());
  LinearCrossEntropyOptions o;
  o.z_loss = 0.01;
  Tensor big = linear_cross_entropy(h, w1, tg, o).loss;
  big.backward();
  Tensor w2 = in.weight.to(DType::f32).to(dev()).requires_grad_();
  LinearCrossEntropyOptions om = o;
  om.num_items = static_cast<double>(count);
  double total = 0;
  for (int64_t part = 0; part < 2; ++part) {
    Tensor l = linear_cross_entropy(h.detach().narrow(0, part * 32, 32), w2, tg.narrow(0, part * 32, 32), om).loss;
    total += l.item();
    l.backward();
  }
  EXPECT_NEAR(total, big.item(), 1e-5 * std::abs(big.item()));
  Tensor a = w1.grad().to(kCPU).to(DType::f64), b = w2.grad().to(kCPU).to(DType::f64);
  EXPECT_LE(max_diff(a, b), 1e-5 * max_abs(a));
}

TEST_P(Lce, DeterministicBits) {
  set_deterministic(true);
  Inputs in = make_inputs(1000, {70, 24}, 333, 0.2);
  const std::vector<Case> cs = option_cases();
  const Case& all = cs[cs.size() - 2];
  LinearCrossEntropyOptions o;
  all.set(o);
  o.chunk_tokens = 16;
  for (int64_t split : {1, 3}) {  // CUDA: the d_hidden product unsplit and split over V
    o.dh_split = split;
    for (DType dt : {DType::f32, DType::bf16}) {
      Outcome a = run(Impl::fused, in, o, true, true, dt, dev());
      Outcome b = run(Impl::fused, in, o, true, true, dt, dev());
      for (auto [x, y] : {std::pair{a.loss, b.loss}, {a.gh, b.gh}, {a.gw, b.gw}, {a.gb, b.gb}, {a.lse, b.lse}}) {
        auto vx = x.to_vector<double>(), vy = y.to_vector<double>();
        ASSERT_EQ(vx.size(), vy.size());
        EXPECT_EQ(0, std::memcmp(vx.data(), vy.data(), vx.size() * sizeof(double))) << dtype_name(dt) << " split "
                                                                                     << split;
      }
    }
  }
  set_deterministic(false);
}

TEST_P(Lce, SecondBackwardWithRetainGraphRecomputes) {
  Inputs in = make_inputs(1100, {10, 8}, 60, 0.1);
  Tensor h = in.hidden.to(DType::f32).to(dev()).requires_grad_();
  Tensor w = in.weight.to(DType::f32).to(dev());
  Tensor loss = linear_cross_entropy(h, w, in.target.to(dev())).loss;
  loss.backward(Tensor(), /*retain_graph=*/true);
  Tensor g1 = h.grad().to(kCPU).to(DType::f64).clone();
  loss.backward();
  Tensor g2 = h.grad().to(kCPU).to(DType::f64);
  EXPECT_LE(max_diff(mul(g1, 2.0), g2), 1e-6 * max_abs(g2));
}

TEST_P(Lce, NoGradForwardOnly) {
  Inputs in = make_inputs(1200, {10, 8}, 60, 0.1);
  Tensor h = in.hidden.to(DType::f32).to(dev()).requires_grad_();
  NoGradGuard ng;
  LinearCrossEntropyResult r = linear_cross_entropy(h, in.weight.to(DType::f32).to(dev()), in.target.to(dev()));
  EXPECT_FALSE(r.loss.requires_grad());
  LinearCrossEntropyResult t = linear_cross_entropy_reference(in.hidden, in.weight, in.target);
  EXPECT_NEAR(r.loss.item(), t.loss.item(), 1e-5 * std::abs(t.loss.item()));
}

TEST_P(Lce, ModuleOwnsItsWeight) {
  Generator gen(5);
  nn::LinearCrossEntropyLoss head(16, 100, LinearCrossEntropyOptions{}, gen, DType::f32, dev());
  EXPECT_TRUE(head.owns_weight());
  EXPECT_EQ(head.weight().shape(), (Shape{100, 16}));
  EXPECT_TRUE(head.weight().requires_grad());
  EXPECT_LE(max_abs(head.weight().to(kCPU).to(DType::f64)), 0.25);
  Inputs in = make_inputs(1300, {6, 16}, 100, 0.0);
  head(in.hidden.to(DType::f32).to(dev()), in.target.to(dev())).loss.backward();
  ASSERT_TRUE(head.weight().grad().defined());
  Tensor w64 = head.weight().detach().to(kCPU).to(DType::f64).requires_grad_();
  linear_cross_entropy_reference(in.hidden, w64, in.target).loss.backward();
  EXPECT_LE(max_diff(w64.grad(), head.weight().grad().to(kCPU).to(DType::f64)), 2e-5 * max_abs(w64.grad()));
}

TEST_P(Lce, Int32TargetsAndGradientFilter) {
  Inputs in = make_inputs(1500, {33, 16}, 257, 0.1);
  Tensor h = in.hidden.to(DType::f32).to(dev()), w = in.weight.to(DType::f32).to(dev());
  LinearCrossEntropyOptions o;
  o.chunk_tokens = 8;
  Tensor base = linear_cross_entropy(h, w, in.target.to(dev()), o).loss;
  Tensor i32 = linear_cross_entropy(h, w, in.target.to(DType::i32).to(dev()), o).loss;
  EXPECT_EQ(base.item(), i32.item());
  // The filter leaves the loss alone and moves the gradient by at most eps per dropped entry.
  auto grad_w = [&](double eps) {
    Tensor wl = w.detach().requires_grad_();
    LinearCrossEntropyOptions of = o;
    of.filter_eps = eps;
    Tensor l = linear_cross_entropy(h, wl, in.target.to(dev()), of).loss;
    l.backward();
    return std::pair{l.item(), wl.grad().to(kCPU).to(DType::f64)};
  };
  auto [l0, g0] = grad_w(0.0);
  auto [l1, g1] = grad_w(1e-3);
  auto [l2, g2] = grad_w(0.5);
  EXPECT_EQ(l0, l1);
  const double bound = 1e-3 * max_abs(in.hidden) * 257 / 30.0;  // eps · |h| · dropped entries / divisor
  EXPECT_LE(max_diff(g0, g1), bound);
  EXPECT_GT(max_diff(g0, g2), 0.0);  // a large eps does drop entries
}

// The CUDA row pass (the persistent kernel) at rows of about 4 KiB to 820 KiB (1003 to 210001
// classes, f32 and bf16, V not a multiple of the 16-byte vector), with every option and ignored
// targets, against the f64 truth.
TEST_P(Lce, RowPassLongRows) {
  if (!dev().is_cuda()) GTEST_SKIP() << "CUDA row pass shapes (the CPU body is covered by the other cases)";
  const std::vector<Case> cs = option_cases();
  const Case& all = cs[cs.size() - 2];
  const Case& none = cs[cs.size() - 1];
  uint64_t seed = 480;
  struct Shape2 {
    int64_t n, v;
    DType dt;
  };
  for (const Shape2& sh : {Shape2{37, 1003, DType::f32}, Shape2{20, 60003, DType::bf16}, Shape2{9, 60003, DType::f32},
                           Shape2{5, 150001, DType::f32}, Shape2{3, 210001, DType::f32}})
    for (const Case* base : {&all, &none}) check_case(*base, {sh.n, 12}, sh.v, sh.dt, 0, ++seed);
}

// The experimental overlap (CUDA): each chunk's d_weight product on a side stream on part of the
// SMs, concurrent with d_hidden. Same results as the truth over several chunks (the side stream
// keeps the chunk order, the next chunk waits for it), and the same bits run to run.
TEST_P(Lce, OverlappedWeightGradient) {
  if (!dev().is_cuda()) GTEST_SKIP() << "dw_sms is a CUDA option (the CPU kernel ignores it)";
  const std::vector<Case> cs = option_cases();
  const Case& all = cs[cs.size() - 2];
  Case c = all;
  c.set = [&all](LinearCrossEntropyOptions& o) {
    all.set(o);
    o.dw_sms = 40;
  };
  check_case(c, {257, 24}, 1003, DType::f32, 64, 490);
  check_case(c, {130, 24}, 5003, DType::bf16, 32, 491);
  set_deterministic(true);
  Inputs in = make_inputs(492, {200, 24}, 2000, 0.2);
  LinearCrossEntropyOptions o;
  c.set(o);
  o.chunk_tokens = 48;
  Outcome a = run(Impl::fused, in, o, true, true, DType::bf16, dev());
  Outcome b = run(Impl::fused, in, o, true, true, DType::bf16, dev());
  for (auto [x, y] : {std::pair{a.gh, b.gh}, {a.gw, b.gw}, {a.gb, b.gb}}) {
    auto vx = x.to_vector<double>(), vy = y.to_vector<double>();
    ASSERT_EQ(vx.size(), vy.size());
    EXPECT_EQ(0, std::memcmp(vx.data(), vy.data(), vx.size() * sizeof(double)));
  }
  set_deterministic(false);
}

// The training path does not wait for the device: the target range check is deferred, the
// mean's divisor stays on the device, and grad_output scales the gradients there (mean, sum
// with num_items, grad_output 1 and not 1, a recomputing second backward).
TEST_P(Lce, NoHostSyncOnTheTrainingPath) {
  if (!dev().is_cuda()) GTEST_SKIP() << "host synchronisation is a CUDA matter";
  Inputs in = make_inputs(1600, {40, 16}, 300, 0.2);
  Tensor tg = in.target.to(dev());
  Tensor w64 = in.weight.clone().requires_grad_();
  linear_cross_entropy_reference(in.hidden, w64, in.target).loss.backward();
  for (int variant = 0; variant < 3; ++variant) {
    Tensor h = in.hidden.to(DType::bf16).to(dev()).requires_grad_();
    Tensor w = in.weight.to(DType::bf16).to(dev()).requires_grad_();
    Tensor go = full({}, variant == 1 ? 0.5 : 1.0, DType::bf16, dev());
    LinearCrossEntropyOptions o;
    if (variant == 2) {
      o.reduction = Reduction::sum;
      o.num_items = 17.0;
    }
    profile::Profiler prof;
    Tensor loss;
    {
      profile::Session on(prof);
      loss = linear_cross_entropy(h, w, tg, o).loss;
      loss.backward(go, /*retain_graph=*/true);
      loss.backward(go);  // recomputes
      EXPECT_EQ(prof.total_syncs(), 0) << "variant " << variant << "\n" << prof.table();
    }
    EXPECT_TRUE(std::isfinite(loss.item()));
    if (variant == 0) {  // mean, grad_output 1, two backwards: twice the reference gradient
      Tensor gw = w.grad().to(kCPU).to(DType::f64);
      EXPECT_LE(max_diff(gw, mul(w64.grad(), 2.0)), 2e-2 * max_abs(w64.grad()));
    }
  }
}

// f must throw a kiln::Error whose message contains `part`.
void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST_P(Lce, BadInputsNameTheProblem) {
  Inputs in = make_inputs(1400, {4, 8}, 10, 0.0);
  Tensor h = in.hidden.to(DType::f32).to(dev()), w = in.weight.to(DType::f32).to(dev());
  Tensor bad = from_vector<int64_t>({1, 2, 10, 3}, {4}).to(dev());
  // On CUDA the target range check is deferred to the next host read (here: item()).
  expect_error([&] { linear_cross_entropy(h, w, bad).loss.item(); },
               "linear_cross_entropy: target[2]=10 out of range [0, 10)");
  Tensor neg = from_vector<int64_t>({1, -5, 0, 3}, {4}).to(dev());
  expect_error([&] { linear_cross_entropy(h, w, neg).loss.item(); }, "target[1]=-5 out of range");
  // After the failure the next call works (the deferred failure was raised once).
  EXPECT_TRUE(std::isfinite(linear_cross_entropy(h, w, in.target.to(dev())).loss.item()));
  expect_error([&] { linear_cross_entropy(h, w.narrow(1, 0, 7).contiguous(), in.target.to(dev())); }, "weight is [10, 7]");
  expect_error([&] { linear_cross_entropy(h, w, in.target.narrow(0, 0, 3).to(dev())); }, "target has shape [3]");
  expect_error([&] { linear_cross_entropy(h, w.to(DType::f64), in.target.to(dev())); }, "weight has dtype f64");
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(DType::f32).to(dev())); }, "target must be i64 or i32");
  LinearCrossEntropyOptions o;
  o.label_smoothing = 1.5;
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o); }, "label_smoothing=1.5");
  o = {};
  o.reduction = Reduction::none;
  o.num_items = 3;
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o); }, "num_items needs reduction mean or sum");
  o = {};
  o.bias = zeros({9}, DType::f32, dev());
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o); }, "bias must be [10]");
  o = {};
  o.weight = ones({10}, DType::f32, dev()).requires_grad_();
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o); }, "class weights that require grad");
  o = {};
  o.softcap = -1;
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o); }, "softcap=-1");
  o = {};
  o.softcap = 1e-300;  // positive, but 0 in f32: it turned softcap off
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o); }, "softcap=1e-300 rounds to 0 in f32");
  if (!dev().is_cuda()) {  // f64 (CPU only) holds it: logits capped to ±1e-300, so the loss is log V
    EXPECT_NEAR(linear_cross_entropy(h.to(DType::f64), w.to(DType::f64), in.target, o).loss.item(), std::log(10.0),
                1e-12);
  }
  o = {};
  o.reduction = static_cast<Reduction>(7);
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o).loss.item(); },
               "reduction=7 is not one of: none, mean, sum");
  expect_error([&] { linear_cross_entropy_reference(h, w, in.target.to(dev()), o); },
               "linear_cross_entropy_reference: reduction=7 is not one of: none, mean, sum");
  o = {};
  o.dh_split = -2;
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o); }, "dh_split=-2 must be >= 0");
  o = {};
  o.dw_sms = -1;
  expect_error([&] { linear_cross_entropy(h, w, in.target.to(dev()), o); }, "dw_sms=-1 must be >= 0");
}

// Options at the edges (from a probe of the op, each wrong before): a softcap or z-loss past
// f32's range (inf · tanh(x / inf) gave NaN), a num_items whose reciprocal overflows, an
// ignore_index no i32 target can equal (an error about `full`), one past 2^53 (the mean counted
// the ignored row), an out-of-range target near INT64_MAX (printed through a double), class
// weights that sum to 0 over the kept targets (the sum's gradients passed as the mean's), and
// the reference, which took bad targets whenever an option sent it off cross_entropy.
TEST_P(Lce, EdgeOptionsAndDivisors) {
  Inputs in = make_inputs(1500, {4, 3}, 5, 0.0);
  Tensor h = in.hidden.to(DType::f32).to(dev()), w = in.weight.to(DType::f32).to(dev());
  auto loss = [&](const Tensor& target, const LinearCrossEntropyOptions& o) {
    return linear_cross_entropy(h, w, target.to(dev()), o).loss.item();
  };
  LinearCrossEntropyOptions o;
  o.softcap = 1e39;
  expect_error([&] { loss(in.target, o); }, "softcap=1e+39 is past f32's range");
  o = {};
  o.z_loss = 1e39;
  expect_error([&] { loss(in.target, o); }, "z_loss=1e+39 is past f32's range");
  o = {};
  o.num_items = 1e-320;
  expect_error([&] { loss(in.target, o); }, "is too small: its reciprocal overflows");
  // An ignore_index outside i32 ignores no i32 target: the plain mean.
  const Tensor t = from_vector<int64_t>({0, 1, 2, 3}, {4});
  const double plain = loss(t, {});
  o = {};
  o.ignore_index = (int64_t{1} << 32) + 1;
  EXPECT_DOUBLE_EQ(loss(t.to(DType::i32), o), plain);
  // One past 2^53, exactly: the mean over the other three rows.
  const int64_t big = (int64_t{1} << 53) + 1;
  o.ignore_index = big;
  LinearCrossEntropyOptions small;
  small.ignore_index = -7;
  const double with_big = loss(from_vector<int64_t>({0, 1, big, 3}, {4}), o);
  EXPECT_NEAR(with_big, loss(from_vector<int64_t>({0, 1, -7, 3}, {4}), small), 1e-6);
  expect_error([&] { loss(from_vector<int64_t>({0, 1, INT64_MAX, 3}, {4}), {}); }, "target[2]=9223372036854775807");
  // Kept targets whose class weights sum to 0, with label smoothing: NaN loss and gradients (as
  // PyTorch's 0 / 0), not the sum's.
  o = {};
  o.weight = from_vector<float>({0, 0, 0, 0, 1}, {5}).to(dev());
  o.label_smoothing = 0.1;
  Tensor hg = h.detach().requires_grad_();
  LinearCrossEntropyResult r = linear_cross_entropy(hg, w, t.to(dev()), o);
  EXPECT_TRUE(std::isnan(r.loss.item()));
  r.loss.backward();
  EXPECT_TRUE(std::isnan(hg.grad().to(kCPU).to_vector<float>()[0]));
  // The reference checks what the fused op checks, on every path.
  o = {};
  o.z_loss = 1e-4;
  const Tensor bad = from_vector<int64_t>({0, 1, 9, 3}, {4}).to(dev());
  expect_error([&] { linear_cross_entropy_reference(h, w, bad, o).loss.item(); },
               "linear_cross_entropy_reference: target[2]=9 out of range");
  o = {};
  o.label_smoothing = 2;
  o.softcap = 1;
  expect_error([&] { linear_cross_entropy_reference(h, w, t.to(dev()), o); },
               "linear_cross_entropy_reference: label_smoothing=2");
  // Inputs changed in place between the forward and the backward are an error, as for any saved
  // tensor (a refilled target buffer changed dh without a word; the reference raised it).
  for (Reduction red : {Reduction::none, Reduction::mean}) {
    o = {};
    o.reduction = red;
    Tensor target = t.to(dev()), hid = h.detach().requires_grad_();
    LinearCrossEntropyResult res = linear_cross_entropy(hid, w, target, o);
    target.fill_(4);
    expect_error([&] { sum(res.loss).backward(); }, "modified by an in-place operation");
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, Lce, ::testing::Values(LceTarget{kCPU}, LceTarget{cuda(0)}, LceTarget{cuda(0), true}),
                         [](const ::testing::TestParamInfo<LceTarget>& i) {
                           return std::string(!i.param.dev.is_cuda() ? "cpu" : i.param.kiln_gemm ? "cuda_kiln_gemm" : "cuda");
                         });

}  // namespace
