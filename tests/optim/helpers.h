// Shared helpers of the optimizer tests: random parameters and gradients from kiln's
// generator, bit comparisons, a checkpoint round trip (JSON text + tensor copies), and
// tolerance checks against float64 references.
#pragma once
#include <cstdint>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kiln/io/json.h"
#include "kiln/ops/ops.h"
#include "kiln/optim/optimizer.h"

namespace kiln::optim::test {

// Named f32 leaf parameters (requires_grad) of the given shapes, drawn from randn(seed).
inline NamedTensors make_params(const std::vector<Shape>& shapes, uint64_t seed) {
  Generator gen(seed);
  NamedTensors ps;
  for (size_t i = 0; i < shapes.size(); ++i) {
    Tensor p = randn(shapes[i], gen);
    p.requires_grad_();
    std::string name = "p";
    name += std::to_string(i);  // (not "p" + to_string: g++ 12 -O3 warns falsely, -Wrestrict)
    ps.emplace_back(name, p);
  }
  return ps;
}

// Copies of the parameters (fresh storage, requires_grad), for a second optimizer.
inline NamedTensors clone_params(const NamedTensors& ps) {
  NamedTensors out;
  for (const auto& [n, p] : ps) {
    Tensor c = p.detach().clone();
    c.requires_grad_();
    out.emplace_back(n, c);
  }
  return out;
}

inline std::vector<double> as_f64(const Tensor& t) { return t.to(DType::f64).to_vector<double>(); }

inline bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  return x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;  // no memcmp of null
}

// What a checkpoint does: the JSON goes through text, the tensors are copied (as if written
// to and read from a file), so nothing aliases the saving optimizer.
inline OptimizerState checkpoint_round_trip(const OptimizerState& s) {
  OptimizerState out;
  out.scalars = json::parse(s.scalars.dump(2));
  for (const auto& [n, t] : s.tensors) out.tensors.emplace_back(n, t.detach().clone());
  return out;
}

inline const Tensor* find_tensor(const OptimizerState& s, const std::string& name) {
  for (const auto& [n, t] : s.tensors)
    if (n == name) return &t;
  return nullptr;
}

// |got - want| <= atol + rtol * |want| elementwise.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, double atol, double rtol,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= atol + rtol * std::fabs(want[i]))) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0u) << what;
}

}  // namespace kiln::optim::test
