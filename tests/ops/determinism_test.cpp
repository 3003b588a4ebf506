// Determinism: with set_deterministic(true), each op's forward and backward run twice on the
// same inputs give identical bits (memcmp), on every available device. Sizes are large enough
// for the CPU kernels to split work across threads and for the reductions to use several blocks.
#include <cstring>

#include "kiln/autograd/grad_mode.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {

struct RunBits {
  std::vector<std::vector<uint8_t>> bytes;
};

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor c = t.to(kCPU).contiguous();
  std::vector<uint8_t> b(c.nbytes());
  if (!b.empty()) std::memcpy(b.data(), c.data_ptr(), b.size());
  return b;
}

// Forward + backward of fn on fresh leaves copied from `inputs`; returns the bits of the
// output and of every floating input's gradient.
RunBits run_once(const std::function<Tensor(const std::vector<Tensor>&)>& fn, const std::vector<Tensor>& inputs,
             const Tensor& w) {
  std::vector<Tensor> in;
  for (const auto& t : inputs) in.push_back(is_floating(t.dtype()) ? t.detach().clone().requires_grad_() : t);
  Tensor y = fn(in);
  sum(mul(y, w)).backward();
  RunBits r;
  r.bytes.push_back(bytes_of(y));
  for (const auto& t : in)
    if (t.requires_grad()) r.bytes.push_back(bytes_of(t.grad()));
  return r;
}

class Determinism : public ::testing::Test {
 protected:
  void SetUp() override { set_deterministic(true); }
  void TearDown() override { set_deterministic(false); }

  void check(const std::string& name, const std::vector<Input>& spec,
             std::function<Tensor(const std::vector<Tensor>&)> fn, DType dt = DType::f32) {
    KILN_TEST_GENERATOR(gen);
    SCOPED_TRACE(name);
    for (Device dev : test_devices()) {
      SCOPED_TRACE(dev.str());
      std::vector<Tensor> in;
      for (const auto& t : make_inputs(spec, gen)) in.push_back((is_floating(t.dtype()) ? t.to(dt) : t).to(dev));
      Tensor y;
      {
        NoGradGuard ng;
        y = fn(in);
      }
      Tensor w = randn(y.shape(), gen, dt, dev);
      RunBits a = run_once(fn, in, w), b = run_once(fn, in, w);
      ASSERT_EQ(a.bytes.size(), b.bytes.size());
      for (size_t i = 0; i < a.bytes.size(); ++i) {
        ASSERT_EQ(a.bytes[i].size(), b.bytes[i].size());
        EXPECT_EQ(0, std::memcmp(a.bytes[i].data(), b.bytes[i].data(), a.bytes[i].size()))
            << (i == 0 ? "output" : "gradient " + std::to_string(i - 1)) << " differs between two runs";
      }
    }
  }
};

}  // namespace

TEST_F(Determinism, Embedding) {
  // Many repeated ids: the scatter-add must sum them in a fixed order.
  for (DType dt : {DType::f32, DType::bf16})
    check("embedding", {{{300, 64}}, idx({64, 64}, 300)}, [](auto& v) { return embedding(v[0], v[1]); }, dt);
}

TEST_F(Determinism, RmsNorm) {
  for (DType dt : {DType::f32, DType::bf16})
    check("rms_norm", {{{600, 96}}, {{96}}}, [](auto& v) { return rms_norm(v[0], v[1]); }, dt);
}

TEST_F(Determinism, Rotary) {
  Input tab{{64, 32}, Input::normal, 0, false, false};
  check("rotary", {{{2, 8, 64, 32}}, tab, tab}, [](auto& v) { return rotary_embedding(v[0], v[1], v[2]); });
}

TEST_F(Determinism, CrossEntropy) {
  for (double ls : {0.0, 0.1})
    check("cross_entropy", {{{128, 500}}, idx({128}, 500)}, [ls](auto& v) {
      CrossEntropyOptions o;
      o.label_smoothing = ls;
      return cross_entropy(v[0], v[1], o);
    });
}

TEST_F(Determinism, Dropout) {
  check("dropout", {{{256, 256}}}, [](auto& v) {
    Generator g(5);
    return dropout(v[0], 0.1, g);
  });
}

TEST_F(Determinism, MatmulReductionsSoftmaxElementwise) {
  check("matmul", {{{4, 64, 96}}, {{96, 80}}}, [](auto& v) { return matmul(v[0], v[1]); });
  check("linear", {{{128, 96}}, {{80, 96}}, {{80}}}, [](auto& v) { return linear(v[0], v[1], v[2]); });
  check("sum", {{{128, 300}}}, [](auto& v) { return sum(v[0], {0}); });
  check("mean all", {{{128, 300}}}, [](auto& v) { return mean(v[0]); });
  check("amax", {{{128, 300}}}, [](auto& v) { return amax(v[0], {-1}); });
  check("softmax", {{{128, 300}}}, [](auto& v) { return softmax(v[0], -1); });
  check("log_softmax", {{{128, 300}}}, [](auto& v) { return log_softmax(v[0], 0); });
  check("silu*x broadcast", {{{128, 300}}, {{300}}}, [](auto& v) { return silu(v[0]) * v[1]; });
}
