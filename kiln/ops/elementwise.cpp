// Elementwise ops with broadcasting: argument checks, autograd formulas, dispatch.
#include <algorithm>
#include <cmath>

#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/elementwise.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/inplace.h"
#include "kiln/ops/ops.h"

namespace kiln {

using kernels::BinaryOp;
using kernels::UnaryOp;

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    KILN_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", a, " and ", b, " cannot be broadcast (dim ", i,
               ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  size_t lead = grad.shape().size() - shape.size();
  std::vector<int64_t> dims;
  for (size_t i = 0; i < grad.shape().size(); ++i)
    if (i < lead || (shape[i - lead] == 1 && grad.shape()[i] != 1)) dims.push_back(static_cast<int64_t>(i));
  Tensor r = dims.empty() ? grad : sum(grad, dims, true);
  return r.reshape(shape);
}

namespace {

void check_same(const Tensor& a, const Tensor& b, const char* op) {
  KILN_CHECK(a.defined() && b.defined(), op, ": undefined tensor argument");
  KILN_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: a is ", dtype_name(a.dtype()), ", b is ",
             dtype_name(b.dtype()), " (convert one with .to(dtype))");
  KILN_CHECK(a.device() == b.device(), op, ": device mismatch: a is on ", a.device().str(), ", b is on ",
             b.device().str());
}

Tensor unary_raw(UnaryOp op, const Tensor& a, double scalar, const char* name) {
  KILN_CHECK(a.defined(), name, ": undefined tensor argument");
  KILN_CHECK(is_floating(a.dtype()), name, ": expected a floating tensor, got ", dtype_name(a.dtype()));
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  KILN_DEVICE_CALL(a.device(), unary, op, out, a, scalar);
  return out;
}

Tensor binary_raw(BinaryOp op, const Tensor& a, const Tensor& b, const char* name) {
  check_same(a, b, name);
  Shape s = broadcast_shapes(a.shape(), b.shape(), name);
  DType out_dtype = kernels::is_comparison(op) ? DType::boolean : a.dtype();
  KILN_CHECK(kernels::is_comparison(op) || a.dtype() != DType::boolean, name, ": arithmetic on bool tensors");
  Tensor out = Tensor::empty(s, out_dtype, a.device());
  Tensor ea = a.shape() == s ? a.detach() : a.detach().expand(s);
  Tensor eb = b.shape() == s ? b.detach() : b.detach().expand(s);
  KILN_DEVICE_CALL(a.device(), binary, op, out, ea, eb);
  return out;
}

// What a unary op's gradient reads: only that is saved (as PyTorch: add_scalar, mul_scalar and
// neg save nothing, so a later in-place write to their input or output is no error, and no
// activation is kept for them).
enum class Saves { nothing, input, output };

// Records a unary op whose gradient is g * deriv(saved), deriv computed by `grad_fn` (the tensor
// it does not save is passed undefined).
Tensor unary_op(UnaryOp op, const Tensor& a, const char* name, Saves saves,
                std::function<Tensor(const Tensor& g, const Tensor& a, const Tensor& y)> grad_fn, double scalar = 0.0) {
  Tensor y = unary_raw(op, a, scalar, name);
  if (any_requires_grad({a})) {
    SavedTensor sa(saves == Saves::input ? a : Tensor()), sy(saves == Saves::output ? y : Tensor());
    std::string n = name;
    record(name, {a}, y, [sa, sy, grad_fn, n](const std::vector<Tensor>& g) {
      return std::vector<Tensor>{grad_fn(g[0], sa.get(n), sy.get(n))};
    });
  }
  return y;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor y = binary_raw(BinaryOp::add, a, b, "add");
  Shape sa = a.shape(), sb = b.shape();
  record("add", {a, b}, y, [sa, sb](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{sum_to(g[0], sa), sum_to(g[0], sb)};
  });
  return y;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor y = binary_raw(BinaryOp::sub, a, b, "sub");
  Shape sa = a.shape(), sb = b.shape();
  record("sub", {a, b}, y, [sa, sb](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{sum_to(g[0], sa), sum_to(neg(g[0]), sb)};
  });
  return y;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor y = binary_raw(BinaryOp::mul, a, b, "mul");
  if (any_requires_grad({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    // Each side's gradient reads the other side only: a side is saved when the other needs it.
    SavedTensor sa(gb ? a : Tensor()), sb(ga ? b : Tensor());
    Shape sha = a.shape(), shb = b.shape();
    record("mul", {a, b}, y, [=](const std::vector<Tensor>& g) {
      return std::vector<Tensor>{ga ? sum_to(mul(g[0], sb.get("mul")), sha) : Tensor(),
                                 gb ? sum_to(mul(g[0], sa.get("mul")), shb) : Tensor()};
    });
  }
  return y;
}

Tensor div(const Tensor& a, const Tensor& b) {
  // Integer division by zero is an error, as PyTorch's on the CPU (the hardware trapped: SIGFPE
  // killed the process). The check reads the divisor's zeros back (a sync on a GPU; integer
  // division is not on a training path). INT_MIN / -1 wraps, as two's complement does.
  if (a.defined() && b.defined() && is_integral(a.dtype()) && a.dtype() == b.dtype() && b.numel() > 0) {
    const Tensor zero = binary_raw(BinaryOp::eq, b, zeros({}, b.dtype(), b.device()), "div").to(kCPU);
    const auto* z = static_cast<const uint8_t*>(zero.data_ptr());  // a new, contiguous tensor
    KILN_CHECK(std::find(z, z + zero.numel(), uint8_t{1}) == z + zero.numel(),
               "div: integer division by zero (the divisor, ", dtype_name(b.dtype()), " ", shape_str(b.shape()),
               ", holds a 0)");
  }
  Tensor y = binary_raw(BinaryOp::div, a, b, "div");
  if (any_requires_grad({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    SavedTensor sa(gb ? a : Tensor()), sb(b);  // a only for b's gradient
    Shape sha = a.shape(), shb = b.shape();
    record("div", {a, b}, y, [=](const std::vector<Tensor>& g) {
      Tensor bb = sb.get("div");
      Tensor gA = ga ? sum_to(div(g[0], bb), sha) : Tensor();
      Tensor gB = gb ? sum_to(neg(div(mul(g[0], sa.get("div")), mul(bb, bb))), shb) : Tensor();
      return std::vector<Tensor>{gA, gB};
    });
  }
  return y;
}

static Tensor select_max_min(BinaryOp op, const Tensor& a, const Tensor& b, const char* name) {
  Tensor y = binary_raw(op, a, b, name);
  if (any_requires_grad({a, b})) {
    SavedTensor sa(a), sb(b);
    Shape sha = a.shape(), shb = b.shape();
    bool is_max = op == BinaryOp::maximum;
    std::string n = name;
    record(name, {a, b}, y, [=](const std::vector<Tensor>& g) {
      // As PyTorch: a tie sends half the gradient to each side, the side that loses gets 0, and
      // a NaN (no side loses a comparison) sends all of it to both.
      const Tensor x = sa.get(n), w = sb.get(n);
      const Tensor share = where(eq(x, w), mul(g[0], 0.5), g[0]), z = zeros_like(g[0]);
      const Tensor a_loses = is_max ? lt(x, w) : gt(x, w), b_loses = is_max ? gt(x, w) : lt(x, w);
      return std::vector<Tensor>{sum_to(where(a_loses, z, share), sha), sum_to(where(b_loses, z, share), shb)};
    });
  }
  return y;
}
Tensor maximum(const Tensor& a, const Tensor& b) { return select_max_min(BinaryOp::maximum, a, b, "maximum"); }
Tensor minimum(const Tensor& a, const Tensor& b) { return select_max_min(BinaryOp::minimum, a, b, "minimum"); }

Tensor add(const Tensor& a, double b) {
  return unary_op(UnaryOp::add_scalar, a, "add_scalar", Saves::nothing,
                  [](const Tensor& g, const Tensor&, const Tensor&) { return g; }, b);
}
Tensor mul(const Tensor& a, double b) {
  return unary_op(UnaryOp::mul_scalar, a, "mul_scalar", Saves::nothing,
                  [b](const Tensor& g, const Tensor&, const Tensor&) { return mul(g, b); }, b);
}
Tensor pow(const Tensor& a, double p) {
  return unary_op(UnaryOp::pow_scalar, a, "pow", Saves::input, [p](const Tensor& g, const Tensor& x, const Tensor&) {
    if (p == 0.0) return zeros_like(g);  // x^0 is 1: as torch, not 0 · x^-1 (NaN at x = 0)
    return mul(g, mul(pow(x, p - 1.0), p));
  }, p);
}
Tensor neg(const Tensor& a) {
  return unary_op(UnaryOp::neg, a, "neg", Saves::nothing,
                  [](const Tensor& g, const Tensor&, const Tensor&) { return neg(g); });
}
Tensor exp(const Tensor& a) {
  return unary_op(UnaryOp::exp, a, "exp", Saves::output,
                  [](const Tensor& g, const Tensor&, const Tensor& y) { return mul(g, y); });
}
Tensor log(const Tensor& a) {
  return unary_op(UnaryOp::log, a, "log", Saves::input,
                  [](const Tensor& g, const Tensor& x, const Tensor&) { return div(g, x); });
}
Tensor sqrt(const Tensor& a) {
  return unary_op(UnaryOp::sqrt, a, "sqrt", Saves::output,
                  [](const Tensor& g, const Tensor&, const Tensor& y) { return div(mul(g, 0.5), y); });
}
Tensor rsqrt(const Tensor& a) {
  return unary_op(UnaryOp::rsqrt, a, "rsqrt", Saves::output, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(mul(g, pow(y, 3.0)), -0.5);
  });
}
Tensor tanh(const Tensor& a) {
  return unary_op(UnaryOp::tanh, a, "tanh", Saves::output, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, add(neg(mul(y, y)), 1.0));
  });
}
Tensor sigmoid(const Tensor& a) {
  return unary_op(UnaryOp::sigmoid, a, "sigmoid", Saves::output, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, mul(y, add(neg(y), 1.0)));
  });
}
Tensor silu(const Tensor& a) {
  return unary_op(UnaryOp::silu, a, "silu", Saves::input, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return mul(g, unary_raw(UnaryOp::silu_deriv, x, 0, "silu_backward"));
  });
}
Tensor gelu(const Tensor& a, bool tanh_approximation) {
  UnaryOp f = tanh_approximation ? UnaryOp::gelu_tanh : UnaryOp::gelu;
  UnaryOp d = tanh_approximation ? UnaryOp::gelu_tanh_deriv : UnaryOp::gelu_deriv;
  return unary_op(f, a, "gelu", Saves::input, [d](const Tensor& g, const Tensor& x, const Tensor&) {
    return mul(g, unary_raw(d, x, 0, "gelu_backward"));
  });
}
Tensor abs(const Tensor& a) {
  return unary_op(UnaryOp::abs, a, "abs", Saves::input, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return mul(g, unary_raw(UnaryOp::sign, x, 0, "abs_backward"));
  });
}
Tensor relu(const Tensor& a) {
  // The gradient is selected, not multiplied, as PyTorch's threshold_backward: 0 where x <= 0
  // even for an inf or NaN gradient (g · 0 gave NaN), g where x > 0 or x is NaN.
  return unary_op(UnaryOp::relu, a, "relu", Saves::input, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return masked_fill(g, le(x, full({}, 0.0, x.dtype(), x.device())), 0.0);
  });
}

Tensor eq(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::eq, a, b, "eq"); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::ne, a, b, "ne"); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::lt, a, b, "lt"); }
Tensor le(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::le, a, b, "le"); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::gt, a, b, "gt"); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::ge, a, b, "ge"); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_same(a, b, "where");
  KILN_CHECK(cond.defined() && cond.dtype() == DType::boolean, "where: condition must be a bool tensor, got ",
             cond.defined() ? dtype_name(cond.dtype()) : "undefined");
  KILN_CHECK(cond.device() == a.device(), "where: condition is on ", cond.device().str(), ", values on ", a.device().str());
  Shape s = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  Tensor out = Tensor::empty(s, a.dtype(), a.device());
  KILN_DEVICE_CALL(a.device(), where, out, cond.expand(s), a.detach().expand(s), b.detach().expand(s));
  if (any_requires_grad({a, b})) {
    SavedTensor sc(cond);
    Shape sha = a.shape(), shb = b.shape();
    record("where", {a, b}, out, [=](const std::vector<Tensor>& g) {
      Tensor c = sc.get("where");
      Tensor z = zeros_like(g[0]);
      return std::vector<Tensor>{sum_to(where(c, g[0], z), sha), sum_to(where(c, z, g[0]), shb)};
    });
  }
  return out;
}

Tensor masked_fill(const Tensor& a, const Tensor& mask, double value) {
  KILN_CHECK(a.defined(), "masked_fill: undefined tensor");
  return where(mask, full({}, value, a.dtype(), a.device()), a);
}

Tensor& add_(Tensor& a, const Tensor& b, double alpha) {
  check_same(a, b, "add_");
  check_inplace_source(b, "add_");  // w.grad was [1, 2, 3] for sum(buf * w) after add_(buf, w), not [2, 4, 6]
  check_inplace(a, "add_");
  Tensor eb = b.shape() == a.shape() ? b : b.expand(a.shape());
  Tensor src = alpha == 1.0 ? eb : mul(eb, alpha);
  KILN_DEVICE_CALL(a.device(), binary, BinaryOp::add, a, a, src);
  return a;
}

Tensor& mul_(Tensor& a, double s) {
  check_inplace(a, "mul_");
  KILN_DEVICE_CALL(a.device(), unary, UnaryOp::mul_scalar, a, a, s);
  return a;
}

}  // namespace kiln
