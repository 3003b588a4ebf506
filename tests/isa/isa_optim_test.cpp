// The CPU AdamW kernels (kernels/cpu/optim.cpp and, on aarch64 with SVE, the SVE set's
// adamw_f32 / adamw_bf16, kernels/cpu/isa/sve_nn.cpp) at odd lengths (1, 3, 17, 129, 1000: every
// predicated tail at 128 and 256 bits):
//  - the fused clipped step (adamw_multi with a clip: gradients times the clip's coefficient
//    inside the update) gives the bits of clip_grad_norm_'s g *= scale then the unclipped step,
//    in the kernel set in use, and both go through the same set (the SVE dispatch counter: a
//    clipped step that fell back to the portable loop while the unclipped one ran SVE gave other
//    bits, and tests/optim's MultiTensor.* failed under qemu's SVE);
//  - the SVE table's scale is one f32 multiply before the update (f32 and bf16 gradients);
//  - NaN and inf in gradients, parameters and moments come out as kernels/optim.h's
//    adamw_update gives them, finite results within 4e-7 of it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kiln/core/half.h"
#include "kiln/kernels/cpu/isa/isa.h"
#include "kiln/kernels/optim.h"
#include "kiln/ops/ops.h"
#include "tests/expect.h"

using namespace kiln;
using kiln::test::same_bits;
namespace isa = kiln::kernels::cpu::isa;
using kernels::AdamWSlot;
using kernels::AdamWStep;

namespace {

constexpr int64_t kLengths[] = {1, 3, 17, 129, 1000};

AdamWStep step_scalars() {
  AdamWStep st;  // step 3 of lr 1e-2, wd 0.1, betas (0.9, 0.999)
  st.lr_wd = 1e-3f, st.beta1 = 0.9f, st.beta2 = 0.999f, st.one_minus_beta1 = 0.1f, st.one_minus_beta2 = 0.001f;
  st.step_size = 1e-2f / (1.0f - 0.729f), st.bias_correction2_sqrt = std::sqrt(1.0f - 0.997003f), st.eps = 1e-8f;
  return st;
}

struct State {
  std::vector<float> p, m, v, g;
};

State random_state(int64_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  State s;
  for (auto* x : {&s.p, &s.m, &s.v, &s.g}) {
    x->resize(static_cast<size_t>(n));
    for (auto& e : *x) e = d(gen);
  }
  for (auto& e : s.v) e = e * e * 1e-2f;
  for (auto& e : s.m) e *= 0.1f;
  return s;
}

void expect_same_state(const State& a, const State& b, const std::string& what) {
  EXPECT_TRUE(same_bits(a.p, b.p)) << what << ": params";
  EXPECT_TRUE(same_bits(a.m, b.m)) << what << ": exp_avg";
  EXPECT_TRUE(same_bits(a.v, b.v)) << what << ": exp_avg_sq";
}

// A CPU tensor over a copy of v (f32), or of v rounded to bf16.
Tensor tensor_of(const std::vector<float>& v, DType t = DType::f32) {
  Tensor x = from_vector(v, {static_cast<int64_t>(v.size())});
  if (t == DType::f32) return x;
  Tensor y = Tensor::empty({static_cast<int64_t>(v.size())}, DType::bf16);
  auto* b = static_cast<BFloat16*>(y.data_ptr());
  for (size_t i = 0; i < v.size(); ++i) b[i] = BFloat16(v[i]);
  return y;
}

// One step of kernels::cpu::adamw_multi over `s` with the clip (norm, coefficient) given.
State multi_step(const State& s, DType gd, double coef) {
  const int64_t n = static_cast<int64_t>(s.p.size());
  Tensor p = tensor_of(s.p), m = tensor_of(s.m), v = tensor_of(s.v), g = tensor_of(s.g, gd);
  Tensor clip = from_vector(std::vector<double>{1.0, coef}, {2});
  AdamWSlot sl;
  sl.p = p.data<float>(), sl.m = m.data<float>(), sl.v = v.data<float>(), sl.g = g.data_ptr(), sl.n = n;
  sl.s = step_scalars(), sl.grad_bf16 = gd == DType::bf16;
  kernels::cpu::adamw_multi(kCPU, {sl}, clip);
  auto back = [n](const Tensor& t) { return std::vector<float>(t.data<float>(), t.data<float>() + n); };
  return {back(p), back(m), back(v), s.g};
}

// The per-parameter step (kernels::cpu::adamw) on gradients g (f32).
State single_step(const State& s, const std::vector<float>& g) {
  const int64_t n = static_cast<int64_t>(s.p.size());
  Tensor p = tensor_of(s.p), m = tensor_of(s.m), v = tensor_of(s.v), gt = tensor_of(g);
  kernels::cpu::adamw(step_scalars(), p, gt, m, v);
  auto back = [n](const Tensor& t) { return std::vector<float>(t.data<float>(), t.data<float>() + n); };
  return {back(p), back(m), back(v), g};
}

uint64_t seed() { return std::random_device{}(); }

}  // namespace

TEST(IsaAdamW, FusedClipIsScaleThenStepBitwiseInTheSetInUse) {
  const uint64_t per_call = isa::sve() ? 1 : 0;  // serial here: every length is one piece, below the grain
  for (int64_t n : kLengths)
    for (double coef : {0.37, 1.0}) {
      const uint64_t sd = seed();
      SCOPED_TRACE("n=" + std::to_string(n) + " coef " + std::to_string(coef) + " seed " + std::to_string(sd));
      const State s = random_state(n, sd);
      const float c = static_cast<float>(coef);
      // clip_grad_norm_: g *= float(coef) in place (ops' mul_ of an f32 tensor: one f32 product)
      std::vector<float> scaled = s.g;
      for (auto& e : scaled) e = e * c;
      const uint64_t c0 = isa::sve_calls();
      const State fused = multi_step(s, DType::f32, coef);
      const uint64_t c1 = isa::sve_calls();
      const State twin = single_step(s, scaled);
      const uint64_t c2 = isa::sve_calls();
      expect_same_state(fused, twin, "fused clip vs scale then step");
      EXPECT_EQ(c1 - c0, per_call) << "the fused (clipped) step's kernel set (" << isa::cpu_features().kernels << ")";
      EXPECT_EQ(c2 - c1, per_call) << "the per-parameter step's kernel set";
      // bf16 gradients: the fused step scales the widened gradient (no rounding to bf16 between):
      // the same bits as the f32 step on float(bf16(g)) * coef.
      std::vector<float> widened = s.g;
      for (auto& e : widened) e = static_cast<float>(BFloat16(e)) * c;
      const uint64_t c3 = isa::sve_calls();
      const State fused16 = multi_step(s, DType::bf16, coef);
      EXPECT_EQ(isa::sve_calls() - c3, per_call) << "the bf16 fused step's kernel set";
      expect_same_state(fused16, single_step(s, widened), "bf16 fused clip vs widened, scaled, f32 step");
    }
}

TEST(IsaAdamW, SveTableScaleIsOneF32MultiplyAtOddLengths) {
  const isa::SveKernels* k = isa::sve_available();
  if (!k) GTEST_SKIP() << "no SVE on this CPU (" << isa::cpu_features().kernels << ")";
  const AdamWStep st = step_scalars();
  for (int64_t n : kLengths) {
    const uint64_t sd = seed();
    SCOPED_TRACE("n=" + std::to_string(n) + " seed " + std::to_string(sd));
    const State s = random_state(n, sd);
    const float scale = 0.0625f * 3.3f;
    std::vector<uint16_t> gb(s.g.size());
    std::vector<float> scaled = s.g, widened = s.g;
    for (size_t i = 0; i < s.g.size(); ++i) {
      gb[i] = BFloat16(s.g[i]).bits;
      scaled[i] = s.g[i] * scale;
      widened[i] = static_cast<float>(BFloat16::from_bits(gb[i])) * scale;
    }
    State a = s, b = s, c = s, d = s;
    k->adamw_f32(a.p.data(), a.m.data(), a.v.data(), s.g.data(), n, st, scale);
    k->adamw_f32(b.p.data(), b.m.data(), b.v.data(), scaled.data(), n, st, 1.0f);
    expect_same_state(a, b, "f32: scaled entry vs pre-scaled gradients");
    k->adamw_bf16(c.p.data(), c.m.data(), c.v.data(), gb.data(), n, st, scale);
    k->adamw_f32(d.p.data(), d.m.data(), d.v.data(), widened.data(), n, st, 1.0f);
    expect_same_state(c, d, "bf16: scaled entry vs widened, pre-scaled gradients");
    EXPECT_FALSE(same_bits(a.p, s.p)) << "the step changed nothing";
  }
}

TEST(IsaAdamW, NanAndInfinityPropagateAsInThePortableUpdate) {
  struct Entry {
    std::string name;
    std::function<void(State&, float)> run;  // one step over the state, gradients times the scale
  };
  std::vector<Entry> entries{{"adamw_multi in use (" + isa::cpu_features().kernels + ")", [](State& s, float scale) {
                                s = multi_step(s, DType::f32, scale);
                              }}};
  if (const auto* k = isa::sve_available())
    entries.push_back({"sve table", [k](State& s, float scale) {
                         const auto n = static_cast<int64_t>(s.p.size());
                         k->adamw_f32(s.p.data(), s.m.data(), s.v.data(), s.g.data(), n, step_scalars(), scale);
                       }});
  const float nan = std::nanf(""), inf = INFINITY;
  for (const Entry& e : entries)
    for (int64_t n : {int64_t{17}, int64_t{129}})
      for (float scale : {1.0f, 0.5f}) {
        const uint64_t sd = seed();
        SCOPED_TRACE(e.name + " n=" + std::to_string(n) + " scale " + std::to_string(scale) + " seed " +
                     std::to_string(sd));
        State s = random_state(n, sd);
        // Non-finite values in every operand, the last ones in the predicated tail.
        const auto last = static_cast<size_t>(n - 1);
        s.g[0] = nan, s.g[1] = inf, s.g[2] = -inf, s.g[last] = nan, s.g[last - 1] = -inf;
        s.p[3] = inf, s.p[4] = nan, s.p[last - 2] = -inf;
        s.m[5] = inf, s.m[6] = nan, s.v[7] = inf, s.v[8] = nan, s.v[last - 3] = inf;
        s.g[9] = 0.0f, s.m[9] = 0.0f, s.v[9] = 0.0f;  // 0 / (0 + eps): the parameter decays only
        State want = s;
        const AdamWStep st = step_scalars();
        for (size_t i = 0; i < s.p.size(); ++i)
          kernels::adamw_update(want.p[i], want.m[i], want.v[i], s.g[i] * scale, st);
        State got = s;
        e.run(got, scale);
        for (size_t i = 0; i < s.p.size(); ++i) {
          struct Val {
            const char* what;
            float got, want, in;
          };
          const Val vals[] = {{"p", got.p[i], want.p[i], s.p[i]}, {"m", got.m[i], want.m[i], s.m[i]},
                              {"v", got.v[i], want.v[i], s.v[i]}};
          for (const Val& x : vals) {
            if (std::isnan(x.want)) {
              EXPECT_TRUE(std::isnan(x.got)) << x.what << " at " << i << ": want NaN, got " << x.got;
            } else if (std::isinf(x.want)) {
              EXPECT_EQ(x.got, x.want) << x.what << " at " << i;
            } else {  // a few roundings of terms no larger than |in| + |want − in|
              const double w = x.want, in = x.in;
              EXPECT_NEAR(x.got, w, 1e-6 * (std::fabs(w) + std::fabs(in) + std::fabs(w - in)) + 1e-30)
                  << x.what << " at " << i;
            }
          }
        }
      }
}
