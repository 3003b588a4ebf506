// Shared helpers of the optimizer tests: random parameters and gradients from kiln's
// generator, float64 copies of tensors for all_close against float64 references, and a
// checkpoint round trip (JSON text + tensor copies). The comparisons are tests/expect.h's.
#pragma once
#include <cstdint>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kiln/io/json.h"
#include "kiln/ops/ops.h"
#include "kiln/optim/optimizer.h"
#include "tests/expect.h"

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

}  // namespace kiln::optim::test
