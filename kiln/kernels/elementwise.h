// Elementwise kernels: the op enums, their host+device math (one definition for both
// backends), and the entry points. Inputs arrive already broadcast (expanded views, any
// strides); outputs are contiguous tensors of the broadcast shape. 16-bit floats compute in f32.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kiln/core/macros.h"
#include "kiln/core/tensor.h"

namespace kiln::kernels {

enum class UnaryOp : uint8_t {
  neg, exp, log, sqrt, rsqrt, tanh, sigmoid, silu, gelu, gelu_tanh, abs, relu, sign,
  add_scalar, mul_scalar, pow_scalar,
  // Derivatives used by backward formulas: d/dx of silu, gelu, gelu_tanh.
  silu_deriv, gelu_deriv, gelu_tanh_deriv,
};

enum class BinaryOp : uint8_t { add, sub, mul, div, maximum, minimum, eq, ne, lt, le, gt, ge };

constexpr bool is_comparison(BinaryOp op) { return op >= BinaryOp::eq; }

template <class A>
KILN_HD A sigmoid_of(A x) {
  using std::exp;
  return A(1) / (A(1) + exp(-x));
}

// SwiGLU, silu(g)·u, and its gradients for an incoming gradient d (ops swiglu: the Llama MLP's
// product, fused): du = d·silu(g), dg = d·u·silu'(g), silu'(g) = σ(g)(1 + g(1 − σ(g))).
template <class A>
KILN_HD A swiglu_math(A g, A u) {
  return g * sigmoid_of(g) * u;
}
template <class A>
KILN_HD void swiglu_grad_math(A d, A g, A u, A& dg, A& du) {
  const A sg = sigmoid_of(g);
  du = d * (g * sg);
  dg = d * u * (sg * (A(1) + g * (A(1) - sg)));
}

// The math of one unary op on the accumulation type A.
template <UnaryOp Op, class A>
KILN_HD A unary_math(A x, A s) {
  using std::exp; using std::log; using std::sqrt; using std::tanh; using std::erf; using std::fabs; using std::pow;
  constexpr A kInvSqrt2 = A(0.70710678118654752440);
  constexpr A kSqrt2OverPi = A(0.79788456080286535588);
  constexpr A kInvSqrt2Pi = A(0.39894228040143267794);
  if constexpr (Op == UnaryOp::neg) return -x;
  else if constexpr (Op == UnaryOp::exp) return exp(x);
  else if constexpr (Op == UnaryOp::log) return log(x);
  else if constexpr (Op == UnaryOp::sqrt) return sqrt(x);
  else if constexpr (Op == UnaryOp::rsqrt) return A(1) / sqrt(x);
  else if constexpr (Op == UnaryOp::tanh) return tanh(x);
  else if constexpr (Op == UnaryOp::sigmoid) return sigmoid_of(x);
  else if constexpr (Op == UnaryOp::silu) return x * sigmoid_of(x);
  else if constexpr (Op == UnaryOp::gelu) return A(0.5) * x * (A(1) + erf(x * kInvSqrt2));
  else if constexpr (Op == UnaryOp::gelu_tanh)
    return A(0.5) * x * (A(1) + tanh(kSqrt2OverPi * (x + A(0.044715) * x * x * x)));
  else if constexpr (Op == UnaryOp::abs) return fabs(x);
  else if constexpr (Op == UnaryOp::relu) return x <= A(0) ? A(0) : x;  // NaN stays NaN, as torch
  else if constexpr (Op == UnaryOp::sign) return x > A(0) ? A(1) : (x < A(0) ? A(-1) : A(0));
  else if constexpr (Op == UnaryOp::add_scalar) return x + s;
  else if constexpr (Op == UnaryOp::mul_scalar) return x * s;
  else if constexpr (Op == UnaryOp::pow_scalar) return pow(x, s);
  else if constexpr (Op == UnaryOp::silu_deriv) {
    A sg = sigmoid_of(x);
    return sg * (A(1) + x * (A(1) - sg));
  } else if constexpr (Op == UnaryOp::gelu_deriv)
    return A(0.5) * (A(1) + erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * exp(A(-0.5) * x * x);
  else if constexpr (Op == UnaryOp::gelu_tanh_deriv) {
    A u = kSqrt2OverPi * (x + A(0.044715) * x * x * x);
    A t = tanh(u);
    return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * kSqrt2OverPi * (A(1) + A(3 * 0.044715) * x * x);
  } else return x;
}

template <BinaryOp Op, class A>
KILN_HD auto binary_math(A a, A b) {
  if constexpr (Op == BinaryOp::add) return a + b;
  else if constexpr (Op == BinaryOp::sub) return a - b;
  else if constexpr (Op == BinaryOp::mul) return a * b;
  else if constexpr (Op == BinaryOp::div) {
    using R = decltype(a / b);
    if constexpr (std::is_integral_v<A>) {  // no trap: 0 divisors are refused by ops::div first
      if (b == A(0)) return R(0);
      if constexpr (std::is_signed_v<A>)
        if (b == A(-1)) return static_cast<R>(R(0) - static_cast<std::make_unsigned_t<R>>(a));  // MIN / -1 wraps
    }
    return a / b;
  }
  else if constexpr (Op == BinaryOp::maximum) return (a != a) ? a : (a > b ? a : b);  // NaN propagates
  else if constexpr (Op == BinaryOp::minimum) return (a != a) ? a : (a < b ? a : b);
  else if constexpr (Op == BinaryOp::eq) return a == b;
  else if constexpr (Op == BinaryOp::ne) return a != b;
  else if constexpr (Op == BinaryOp::lt) return a < b;
  else if constexpr (Op == BinaryOp::le) return a <= b;
  else if constexpr (Op == BinaryOp::gt) return a > b;
  else return a >= b;
}

// Calls f.template operator()<Op>() for the run-time op.
template <class F>
decltype(auto) dispatch_unary_op(UnaryOp op, F&& f) {
#define KILN_UNARY_CASE(name) case UnaryOp::name: return f.template operator()<UnaryOp::name>();
  switch (op) {
    KILN_UNARY_CASE(neg) KILN_UNARY_CASE(exp) KILN_UNARY_CASE(log) KILN_UNARY_CASE(sqrt)
    KILN_UNARY_CASE(rsqrt) KILN_UNARY_CASE(tanh) KILN_UNARY_CASE(sigmoid) KILN_UNARY_CASE(silu)
    KILN_UNARY_CASE(gelu) KILN_UNARY_CASE(gelu_tanh) KILN_UNARY_CASE(abs) KILN_UNARY_CASE(relu)
    KILN_UNARY_CASE(sign) KILN_UNARY_CASE(add_scalar) KILN_UNARY_CASE(mul_scalar)
    KILN_UNARY_CASE(pow_scalar) KILN_UNARY_CASE(silu_deriv) KILN_UNARY_CASE(gelu_deriv)
    KILN_UNARY_CASE(gelu_tanh_deriv)
  }
#undef KILN_UNARY_CASE
  return f.template operator()<UnaryOp::neg>();
}

template <class F>
decltype(auto) dispatch_binary_op(BinaryOp op, F&& f) {
#define KILN_BINARY_CASE(name) case BinaryOp::name: return f.template operator()<BinaryOp::name>();
  switch (op) {
    KILN_BINARY_CASE(add) KILN_BINARY_CASE(sub) KILN_BINARY_CASE(mul) KILN_BINARY_CASE(div)
    KILN_BINARY_CASE(maximum) KILN_BINARY_CASE(minimum) KILN_BINARY_CASE(eq) KILN_BINARY_CASE(ne)
    KILN_BINARY_CASE(lt) KILN_BINARY_CASE(le) KILN_BINARY_CASE(gt) KILN_BINARY_CASE(ge)
  }
#undef KILN_BINARY_CASE
  return f.template operator()<BinaryOp::add>();
}

namespace cpu {
void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar);
void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
}  // namespace cpu
namespace cuda {
void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar);
void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
}  // namespace cuda

}  // namespace kiln::kernels
