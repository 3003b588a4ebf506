// matmul (numpy semantics, broadcast batch dims), linear and swiglu_linear (ops/fused.h), with
// autograd. Operands whose last two dims are a transposed contiguous matrix go to the gemm
// kernel without a copy.
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/matmul.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/fused.h"
#include "kiln/ops/ops.h"

namespace kiln {
namespace {

// The operand checks matmul and linear share: defined, one floating dtype, one device.
void check_operands(const Tensor& a, const Tensor& b, const char* op, const char* an, const char* bn) {
  KILN_CHECK(a.defined() && b.defined(), op, ": undefined tensor argument");
  KILN_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: ", an, " is ", dtype_name(a.dtype()), ", ", bn, " is ",
             dtype_name(b.dtype()));
  KILN_CHECK(a.device() == b.device(), op, ": device mismatch: ", an, " is on ", a.device().str(), ", ", bn,
             " is on ", b.device().str());
  KILN_CHECK(is_floating(a.dtype()), op, ": expected floating tensors, got ", dtype_name(a.dtype()));
}

struct Operand {
  Tensor data;          // contiguous: [rows, cols] (broadcast) or [batch, rows, cols]
  bool trans = false;   // data holds the transpose of the logical matrix
  int64_t batch_stride = 0;
};

// Prepares x (logical [..., r, c], batch shape `batch`) for gemm.
Operand prepare(const Tensor& x, const Shape& batch, int64_t batch_numel) {
  Operand o;
  const int64_t r = x.size(-2), c = x.size(-1);
  bool has_batch = false;
  for (int64_t d = 0; d + 2 < x.dim(); ++d)
    if (x.shape()[static_cast<size_t>(d)] != 1) has_batch = true;
  if (!has_batch) {
    Tensor m = x.reshape({r, c});
    if (!m.is_contiguous() && m.transpose(0, 1).is_contiguous()) {
      o.data = m;
      o.trans = true;
    } else {
      o.data = m.contiguous();
    }
    o.batch_stride = 0;
    return o;
  }
  Shape full = batch;
  full.push_back(r);
  full.push_back(c);
  o.data = x.expand(full).contiguous().reshape({batch_numel, r, c});
  o.batch_stride = r * c;
  return o;
}

Tensor matmul_raw(const Tensor& a, const Tensor& b) {
  // a [..., m, k], b [..., k, n], both at least 2-D.
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  KILN_CHECK(b.size(-2) == k, "matmul: inner dimensions differ: a is ", a.shape(), ", b is ", b.shape());
  Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  Shape batch = broadcast_shapes(ba, bb, "matmul");
  int64_t batch_numel = shape_numel(batch);
  Operand oa = prepare(a.detach(), batch, batch_numel), ob = prepare(b.detach(), batch, batch_numel);
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  Tensor out = Tensor::empty(out_shape, a.dtype(), a.device());
  kernels::GemmArgs g;
  g.batch = batch_numel;
  g.m = m;
  g.n = n;
  g.k = k;
  g.trans_a = oa.trans;
  g.trans_b = ob.trans;
  g.batch_stride_a = oa.batch_stride;
  g.batch_stride_b = ob.batch_stride;
  KILN_DEVICE_CALL(a.device(), gemm, g, out, oa.data, ob.data);
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  check_operands(a_in, b_in, "matmul", "a", "b");
  KILN_CHECK(a_in.dim() >= 1 && b_in.dim() >= 1, "matmul: operands must have at least one dim (a is ", a_in.shape(),
             ", b is ", b_in.shape(), ")");
  // 1-D operands as numpy: a [k] → [1, k], b [k] → [k, 1], squeezed afterwards.
  Tensor a = a_in.dim() == 1 ? a_in.unsqueeze(0) : a_in;
  Tensor b = b_in.dim() == 1 ? b_in.unsqueeze(1) : b_in;
  Tensor y = matmul_raw(a, b);
  if (any_requires_grad({a, b})) {
    SavedTensor sa(a), sb(b);
    bool ga = a.requires_grad(), gb = b.requires_grad();
    Shape sha = a.shape(), shb = b.shape();
    record("matmul", {a, b}, y, [=](const std::vector<Tensor>& g) {
      Tensor gA, gB;
      if (ga) gA = sum_to(matmul(g[0], sb.get("matmul").transpose(-1, -2)), sha);
      if (gb) gB = sum_to(matmul(sa.get("matmul").transpose(-1, -2), g[0]), shb);
      return std::vector<Tensor>{gA, gB};
    });
  }
  if (a_in.dim() == 1) y = y.squeeze(-2);
  if (b_in.dim() == 1) y = y.squeeze(-1);
  return y;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_operands(x, weight, "linear", "input", "weight");
  KILN_CHECK(weight.dim() == 2, "linear: weight must be 2-D [out, in], got ", weight.shape());
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "linear: input features ", x.dim() ? x.size(-1) : 0,
             " differ from weight's in_features ", weight.size(1), " (input ", x.shape(), ", weight ", weight.shape(), ")");
  Shape out_shape = x.shape();
  out_shape.back() = weight.size(0);
  // The rows counted, not inferred: with in_features 0, -1 is ambiguous for 0 elements (torch: zeros).
  const int64_t rows = shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
  const int64_t in = weight.size(1), out = weight.size(0);
  Tensor x2 = x.detach().reshape({rows, in});
  Tensor y = matmul_raw(x2, weight.detach().t()).reshape(out_shape);
  if (any_requires_grad({x, weight})) {
    // Its own node, not matmul's with weight.t(): the weight's gradient is the product gᵀ·x,
    // [out, in] as the weight is (through matmul's node it was a transposed view of xᵀ·g, which
    // every later step, the bf16 cast back to f32 and the accumulation, copied through strides).
    SavedTensor sx(x2), sw(weight.detach());
    const bool gx = x.requires_grad(), gw = weight.requires_grad();
    const Shape xs = x.shape();
    record("linear", {x, weight}, y, [=](const std::vector<Tensor>& g) {
      Tensor g2 = g[0].reshape({rows, out});
      Tensor dx, dw;
      if (gx) dx = matmul(g2, sw.get("linear")).reshape(xs);
      if (gw) dw = matmul(g2.t(), sx.get("linear"));
      return std::vector<Tensor>{dx, dw};
    });
  }
  if (bias.defined()) {
    KILN_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), "linear: bias must be [", weight.size(0), "], got ",
               bias.shape());
    y = add(y, bias);
  }
  return y;
}

Tensor swiglu_linear(const Tensor& gate, const Tensor& up, const Tensor& weight) {
  KILN_CHECK(gate.defined() && up.defined(), "swiglu_linear: undefined tensor argument");
  KILN_CHECK(gate.shape() == up.shape(), "swiglu_linear: gate shape ", gate.shape(), " differs from up shape ",
             up.shape());
  check_operands(gate, up, "swiglu_linear", "gate", "up");
  check_operands(gate, weight, "swiglu_linear", "gate", "weight");
  KILN_CHECK(weight.dim() == 2 && gate.dim() >= 1 && gate.size(-1) == weight.size(1), "swiglu_linear: weight ",
             weight.shape(), " must be [out, in] with in = the last dim of gate ", gate.shape());
  const Tensor gc = gate.detach().contiguous(), uc = up.detach().contiguous();
  const Shape in_shape = gate.shape();
  Shape out_shape = in_shape;
  out_shape.back() = weight.size(0);
  const int64_t rows = shape_numel(Shape(in_shape.begin(), in_shape.end() - 1));
  const int64_t in = weight.size(1), out = weight.size(0);
  // The product (swiglu of the detached inputs: no node), held only until the product with the
  // weight is done.
  Tensor y = matmul_raw(swiglu(gc, uc).reshape({rows, in}), weight.detach().t()).reshape(out_shape);
  if (any_requires_grad({gate, up, weight})) {
    SavedTensor sg(gc), su(uc), sw(weight.detach());
    const bool gw = weight.requires_grad();
    record("swiglu_linear", {gate, up, weight}, y, [=](const std::vector<Tensor>& g) {
      const Tensor gg = sg.get("swiglu_linear"), uu = su.get("swiglu_linear");
      const Tensor g2 = g[0].reshape({rows, out});
      // linear's backward (ops/matmul.cpp: linear), then swiglu's (ops/nn.cpp: swiglu), in the
      // order the engine runs the unfused pair: the same products, the same bits.
      const Tensor dprod = matmul(g2, sw.get("swiglu_linear")).reshape(in_shape).contiguous();
      Tensor dw;
      if (gw) dw = matmul(g2.t(), swiglu(gg, uu).reshape({rows, in}));
      std::vector<Tensor> grads = detail::swiglu_grads(dprod, gg, uu);
      grads.push_back(dw);
      return grads;
    });
  }
  return y;
}

}  // namespace kiln
