// The one op test harness (ARCHITECTURE.md pattern 4, after ggml test-backend-ops and candle's
// test_device!): an op is a lambda over input tensors; check_op runs it on every available
// device, in every tested dtype, on contiguous and non-contiguous inputs, and compares
//   - each dtype against the same op computed in float64 on the same (rounded) inputs,
//   - float64 gradients against central finite differences (small shapes),
//   - each dtype's gradients against the float64 gradients.
// Inputs are fresh random numbers each run from a Generator seeded by test_seed() (printed on
// failure; set KILN_TEST_SEED to replay). Outputs land in NaN-poisoned destinations.
#pragma once
#include <cstdint>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/ops.h"
#include "tests/expect.h"
#include "tests/skip.h"

namespace kiln::test {

// CPU always; cuda(0) when a GPU is visible.
inline std::vector<Device> test_devices() {
  std::vector<Device> d{kCPU};
  if (cuda_device_count() > 0) d.push_back(cuda(0));
  return d;
}

// The seed of a test's random inputs: KILN_TEST_SEED when set; else, under --gtest_shuffle,
// GoogleTest's random seed mixed with the test's name (so --gtest_random_seed replays a run);
// else a fresh one each run.
inline uint64_t test_seed() {
  if (const char* s = std::getenv("KILN_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  const auto* ut = ::testing::UnitTest::GetInstance();
  if (ut->random_seed() != 0 && ut->current_test_info()) {
    std::string name = std::string(ut->current_test_info()->test_suite_name()) + "." + ut->current_test_info()->name();
    return static_cast<uint64_t>(ut->random_seed()) * 0x9E3779B97F4A7C15ull ^ std::hash<std::string>{}(name);
  }
  return (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
}

// A generator with a fresh seed; the seed is attached to every failure of the calling scope.
#define KILN_TEST_GENERATOR(gen)                                            \
  const uint64_t gen##_seed = ::kiln::test::test_seed();                    \
  SCOPED_TRACE("seed " + std::to_string(gen##_seed) + " (replay with KILN_TEST_SEED=" + \
               std::to_string(gen##_seed) + ")");                            \
  ::kiln::Generator gen(gen##_seed)

// One input of an op under test.
struct Input {
  Shape shape;
  enum Kind { normal, positive, index, mask } kind = normal;
  int64_t high = 0;     // index: values in [0, high)
  bool grad = true;     // floating inputs: check its gradient
  bool cast = true;     // floating inputs: follow the tested dtype (false: stays f32)
};
inline Input idx(Shape s, int64_t high) { return {std::move(s), Input::index, high, false, false}; }
inline Input bmask(Shape s) { return {std::move(s), Input::mask, 0, false, false}; }
inline Input positive(Shape s) { return {std::move(s), Input::positive, 0, true, true}; }
inline Input nograd(Shape s) { return {std::move(s), Input::normal, 0, false, true}; }

using OpFn = std::function<Tensor(const std::vector<Tensor>&)>;

struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  OpFn fn;
  std::vector<DType> dtypes{DType::f64, DType::f32, DType::f16, DType::bf16};
  bool check_grad = true;       // finite differences in f64 and grads per dtype
  bool noncontiguous = true;    // also run on strided copies of the inputs
  double tol_scale = 1.0;       // multiplies the dtype tolerances (long reductions)
  double fd_tol = 1e-6;
};

// f64 CPU master inputs.
inline std::vector<Tensor> make_inputs(const std::vector<Input>& spec, Generator& gen) {
  std::vector<Tensor> v;
  for (const auto& in : spec) {
    switch (in.kind) {
      case Input::normal: v.push_back(randn(in.shape, gen, DType::f64)); break;
      case Input::positive: v.push_back(add(rand(in.shape, gen, DType::f64), 0.5)); break;
      case Input::index: v.push_back(mul(rand(in.shape, gen, DType::f64), static_cast<double>(in.high)).to(DType::i64)); break;
      case Input::mask: v.push_back(lt(rand(in.shape, gen, DType::f64), full({}, 0.5, DType::f64))); break;
    }
  }
  return v;
}

// The same values in a non-contiguous layout: every dim strided by 2 inside a larger buffer,
// then the dims reversed twice (a permuted view) for rank >= 2.
inline Tensor strided_copy(const Tensor& t) {
  if (t.dim() == 0) return t;
  Shape big = t.shape();
  std::vector<int64_t> rev;
  for (int64_t d = t.dim() - 1; d >= 0; --d) rev.push_back(d);
  Shape rshape;
  for (auto d : rev) rshape.push_back(big[static_cast<size_t>(d)]);
  rshape.back() *= 2;
  // Poisoned gaps: NaN for floats, 0 for integer and bool tensors.
  Tensor buf = full(rshape, is_floating(t.dtype()) ? std::nan("") : 0.0, t.dtype(), t.device());
  Tensor v = buf.slice(-1, 0, rshape.back(), 2).permute(rev);
  v.copy_(t);
  return v;
}

inline Tensor prepare(const Tensor& master, const Input& in, DType dt, Device dev, bool strided) {
  Tensor t = master;
  if (is_floating(t.dtype())) t = t.to(in.cast ? dt : DType::f32);
  t = t.to(dev);
  return strided ? strided_copy(t) : t;
}

// Runs op into a NaN-poisoned destination.
inline Tensor run_poisoned(const OpFn& fn, const std::vector<Tensor>& in) {
  Tensor y = fn(in);
  if (!is_floating(y.dtype())) return y;
  Tensor dst = full(y.shape(), std::nan(""), y.dtype(), y.device());
  NoGradGuard ng;
  dst.copy_(y);
  return dst;
}

// The finite-difference slope to compare an analytic gradient g with, from the one-sided
// slopes right and left of x (step h). Where they agree (a smooth point) it is their mean, the
// central difference. Where they differ (x within h of a kink such as abs at 0, relu, or a tie
// of max) the derivative is one-sided: an analytic gradient that matches one side is taken as
// that side's, anything else keeps the central difference and fails the check.
inline double fd_at_kink_or_central(double g, double right, double left) {
  const double central = 0.5 * (right + left);
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-4 * (1.0 + std::abs(b)); };
  if (near(right, left)) return central;
  if (near(g, right)) return right;
  if (near(g, left)) return left;
  return central;
}

// Random weights w for L = sum(y * w); returns L's gradients w.r.t. the grad inputs.
inline std::vector<Tensor> grads_of(const OpCase& c, std::vector<Tensor> in, const Tensor& w) {
  for (size_t i = 0; i < in.size(); ++i)
    if (c.inputs[i].grad && is_floating(in[i].dtype())) in[i] = in[i].detach().requires_grad_();
  Tensor y = c.fn(in);
  sum(mul(y, w.to(y.dtype()))).backward();
  std::vector<Tensor> g;
  for (size_t i = 0; i < in.size(); ++i)
    g.push_back(in[i].requires_grad() ? (in[i].grad().defined() ? in[i].grad() : zeros_like(in[i])) : Tensor());
  return g;
}

inline void check_op(const OpCase& c) {
  KILN_TEST_GENERATOR(gen);
  SCOPED_TRACE("op " + c.name);
  std::vector<Tensor> master = make_inputs(c.inputs, gen);
  // Reference: f64 on the CPU.
  for (Device dev : test_devices()) {
    SCOPED_TRACE("device " + dev.str());
    std::vector<bool> layouts{false};
    if (c.noncontiguous) layouts.push_back(true);
    Tensor w;  // gradient weights, drawn once per device
    std::vector<Tensor> ref_grads;
    if (c.check_grad) {
      std::vector<Tensor> in64;
      for (size_t i = 0; i < master.size(); ++i) in64.push_back(prepare(master[i], c.inputs[i], DType::f64, dev, false));
      Tensor y;
      {
        NoGradGuard ng;
        y = c.fn(in64);
      }
      w = randn(y.shape(), gen, DType::f64).to(dev);
      ref_grads = grads_of(c, in64, w);
      // Central finite differences of L = sum(y * w) in f64.
      const double h = 1e-6;
      NoGradGuard ng;
      for (size_t i = 0; i < in64.size(); ++i) {
        if (!ref_grads[i].defined()) continue;
        Tensor base = in64[i].to(kCPU).contiguous().clone();
        std::vector<double> vals = base.to_vector<double>();
        const std::vector<double> analytic = ref_grads[i].to(kCPU).contiguous().to_vector<double>();
        std::vector<double> fd(vals.size());
        for (size_t k = 0; k < vals.size(); ++k) {
          auto eval = [&](double x) {
            std::vector<double> v = vals;
            v[k] = x;
            std::vector<Tensor> in = in64;
            in[i] = from_vector(v, base.shape(), dev);
            return sum(mul(c.fn(in), w)).item();
          };
          const double at = eval(vals[k]), up = eval(vals[k] + h), down = eval(vals[k] - h);
          fd[k] = fd_at_kink_or_central(analytic[k], (up - at) / h, (at - down) / h);
        }
        EXPECT_TRUE(all_close(ref_grads[i].to(DType::f64), from_vector(fd, base.shape()), {c.fd_tol, c.fd_tol},
                              "grad of input " + std::to_string(i) + " vs finite differences"));
      }
    }
    for (DType dt : c.dtypes) {
      for (bool strided : layouts) {
        SCOPED_TRACE(std::string("dtype ") + dtype_name(dt) + (strided ? ", strided inputs" : ", contiguous inputs"));
        std::vector<Tensor> in, in_ref;
        for (size_t i = 0; i < master.size(); ++i) {
          in.push_back(prepare(master[i], c.inputs[i], dt, dev, strided));
          in_ref.push_back(is_floating(in.back().dtype()) ? in.back().to(DType::f64).to(kCPU) : in.back().to(kCPU));
        }
        Tensor y, ref;
        {
          NoGradGuard ng;
          y = run_poisoned(c.fn, in);
          ref = c.fn(in_ref);
        }
        EXPECT_EQ(y.device(), dev);
        EXPECT_EQ(is_floating(y.dtype()), is_floating(ref.dtype()));
        Tol tol = default_tol(dt);
        tol.atol *= c.tol_scale;
        tol.rtol *= c.tol_scale;
        EXPECT_TRUE(all_close(y.to(DType::f64), ref.to(DType::f64), tol, "output"));  // y in dt, ref in f64
        if (c.check_grad && dt != DType::f64) {
          // Reference gradients: f64 on the same rounded inputs (kinks such as max/relu move
          // with the rounding), on the same device.
          std::vector<Tensor> in_ref_dev;
          for (const auto& t : in_ref) in_ref_dev.push_back(t.to(dev));
          auto rg = grads_of(c, in_ref_dev, w);
          auto g = grads_of(c, in, w);
          Tol gt = tol;
          gt.atol *= 4;
          gt.rtol *= 4;
          for (size_t i = 0; i < g.size(); ++i)
            if (g[i].defined() && rg[i].defined()) {
              EXPECT_TRUE(all_close(g[i].to(DType::f64), rg[i], gt, "grad of input " + std::to_string(i)));
            }
        }
      }
    }
  }
}

// HasSubstr without gmock (the GPU machine builds GoogleTest without it).
inline ::testing::AssertionResult has_substr(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "message \"" << text << "\" does not contain \"" << part << "\"";
}

// Expects `stmt` to throw kiln::Error whose message contains every piece of `parts`.
#define EXPECT_KILN_ERROR(stmt, ...)                                                       \
  do {                                                                                     \
    try {                                                                                  \
      stmt;                                                                                \
      ADD_FAILURE() << "expected kiln::Error from: " #stmt;                                \
    } catch (const ::kiln::Error& e) {                                                     \
      for (const char* part : {__VA_ARGS__})                                               \
        EXPECT_TRUE(::kiln::test::has_substr(e.what(), part)) << "from: " #stmt;            \
    }                                                                                      \
  } while (0)

}  // namespace kiln::test
