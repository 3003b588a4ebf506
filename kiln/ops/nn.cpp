// Neural-network ops: embedding, rms_norm, swiglu, rotary_embedding (+ rotary_tables) and
// dropout: argument checks, dispatch to kernels/nn.h, and their backward formulas.
// cross_entropy lives in kiln/ops/loss.cpp.
#include <cmath>
#include <string>

#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/nn.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/fused.h"
#include "kiln/ops/index_check.h"
#include "kiln/ops/ops.h"

namespace kiln {
namespace {

void check_defined(const Tensor& t, const char* op, const char* arg) {
  KILN_CHECK(t.defined(), op, ": argument '", arg, "' is an undefined tensor");
}
void check_same_device(const Tensor& a, const Tensor& b, const char* op, const char* an, const char* bn) {
  KILN_CHECK(a.device() == b.device(), op, ": device mismatch: ", an, " is on ", a.device().str(), ", ", bn,
             " is on ", b.device().str());
}

}  // namespace

// ---- index range checks (index_check.h) ----

void detail::check_index_range(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore, const std::string& what,
                               const std::string& tail) {
  if (ids.device().is_cuda()) {  // CUDA only: no host synchronisation (kernels/nn.h)
    profile::Scope ps("defer_range_check", ids.device());
    kernels::cuda::defer_range_check(ids, lo, hi, ignore, what, tail);
    return;
  }
  int64_t bad = KILN_DEVICE_CALL(ids.device(), first_out_of_range, ids, lo, hi, ignore);
  // The value read as an integer (item() goes through a double: 2^62 + 1 printed as 2^62, and
  // INT64_MAX's cast back was undefined).
  if (bad >= 0) {
    const int64_t value = ids.view({-1}).slice(0, bad, bad + 1).to(DType::i64).to_vector<int64_t>()[0];
    fail(what, "[", bad, "]=", value, tail);
  }
}

size_t detail::deferred_check_count(Device device) {
  return device.is_cuda() ? kernels::cuda::deferred_check_count(device.index) : 0;
}

detail::DeferredChecks detail::deferred_checks_since(Device device, size_t mark) {
  DeferredChecks c;
  c.mark = mark;
  if (device.is_cuda()) c.checks = kernels::cuda::deferred_checks_since(device.index, mark);
  return c;
}

void detail::requeue_deferred_checks(Device device, const DeferredChecks& c) {
  if (device.is_cuda()) kernels::cuda::requeue_deferred_checks(device.index, c.mark, c.checks);
}

void synchronize(Device device) {
  if (device.is_cuda()) kernels::cuda::synchronize_and_check(device.index);
}

// ---- embedding ----

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  check_defined(weight, "embedding", "weight");
  check_defined(ids, "embedding", "ids");
  KILN_CHECK(weight.dim() == 2, "embedding: weight must be 2-D [vocab, dim], got shape ", weight.shape());
  KILN_CHECK(is_floating(weight.dtype()), "embedding: weight must be floating, got ", dtype_name(weight.dtype()));
  KILN_CHECK(ids.dtype() == DType::i64 || ids.dtype() == DType::i32, "embedding: ids must be i64 or i32, got ",
             dtype_name(ids.dtype()));
  check_same_device(weight, ids, "embedding", "weight", "ids");
  const int64_t vocab = weight.size(0), d = weight.size(1);
  Tensor idc = ids.contiguous();
  // The range check lets its `ignore` value (0 here) through: with no rows, id 0 read past them.
  KILN_CHECK(vocab > 0 || ids.numel() == 0, "embedding: weight has no rows (shape ", weight.shape(), ") for ",
             ids.numel(), " ids");
  detail::check_index_range(idc, 0, vocab, 0, "embedding: ids", " out of range [0, " + std::to_string(vocab) + ")");
  Shape out_shape = ids.shape();
  out_shape.push_back(d);
  Tensor out = Tensor::empty({idc.numel(), d}, weight.dtype(), weight.device());
  if (out.numel() > 0) KILN_DEVICE_CALL(weight.device(), embedding_forward, out, weight.detach().contiguous(), idc);
  out = out.view(out_shape);
  SavedTensor sids(idc);
  record("embedding", {weight}, out, [sids, vocab, d](const std::vector<Tensor>& g) {
    Tensor ids2 = sids.get("embedding");
    Tensor dw = Tensor::empty({vocab, d}, g[0].dtype(), g[0].device());
    if (ids2.numel() == 0 || d == 0) dw.zero_();
    else KILN_DEVICE_CALL(dw.device(), embedding_backward, dw, g[0].contiguous().view({ids2.numel(), d}), ids2);
    return std::vector<Tensor>{dw};
  });
  return out;
}

// ---- rms_norm ----

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_defined(x, "rms_norm", "x");
  check_defined(weight, "rms_norm", "weight");
  KILN_CHECK(is_floating(x.dtype()), "rms_norm: x must be floating, got ", dtype_name(x.dtype()));
  KILN_CHECK(x.dim() >= 1, "rms_norm: x must have at least 1 dim, got a scalar");
  KILN_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight shape ", weight.shape(),
             " does not match the last dim of x ", x.shape());
  KILN_CHECK(weight.dtype() == x.dtype(), "rms_norm: dtype mismatch: x is ", dtype_name(x.dtype()), ", weight is ",
             dtype_name(weight.dtype()));
  check_same_device(x, weight, "rms_norm", "x", "weight");
  KILN_CHECK(eps >= 0 && std::isfinite(eps), "rms_norm: eps must be finite and >= 0, got ", eps);
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  const DType sd = compute_dtype(x.dtype());
  Tensor xc = x.detach().contiguous(), wc = weight.detach().contiguous();
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor rstd = Tensor::empty({rows}, sd, x.device());
  if (out.numel() > 0) KILN_DEVICE_CALL(x.device(), rms_norm_forward, out, rstd, xc, wc, eps);
  if (any_requires_grad({x, weight})) {
    SavedTensor sx(xc), sw(wc), sr(rstd);
    const bool gw = weight.requires_grad();
    record("rms_norm", {x, weight}, out, [sx, sw, sr, gw, d](const std::vector<Tensor>& g) {
      Tensor xx = sx.get("rms_norm");
      Tensor dx = Tensor::empty(xx.shape(), xx.dtype(), xx.device());
      Tensor dw = gw ? Tensor::empty({d}, xx.dtype(), xx.device()) : Tensor();
      if (xx.numel() > 0)
        KILN_DEVICE_CALL(xx.device(), rms_norm_backward, dx, dw, g[0].contiguous(), xx, sw.get("rms_norm"),
                         sr.get("rms_norm"));
      else if (gw)
        dw.zero_();
      return std::vector<Tensor>{dx, dw};
    });
  }
  return out;
}

// ---- swiglu ----

std::vector<Tensor> detail::swiglu_grads(const Tensor& dout, const Tensor& gate, const Tensor& up) {
  Tensor dg = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  Tensor du = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  if (gate.numel() > 0) KILN_DEVICE_CALL(gate.device(), swiglu_backward, dg, du, dout, gate, up);
  return {dg, du};
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  check_defined(gate, "swiglu", "gate");
  check_defined(up, "swiglu", "up");
  KILN_CHECK(is_floating(gate.dtype()), "swiglu: gate must be floating, got ", dtype_name(gate.dtype()));
  KILN_CHECK(gate.dtype() == up.dtype(), "swiglu: dtype mismatch: gate is ", dtype_name(gate.dtype()), ", up is ",
             dtype_name(up.dtype()));
  KILN_CHECK(gate.shape() == up.shape(), "swiglu: gate shape ", gate.shape(), " differs from up shape ", up.shape());
  check_same_device(gate, up, "swiglu", "gate", "up");
  Tensor gc = gate.detach().contiguous(), uc = up.detach().contiguous();
  Tensor out = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  if (out.numel() > 0) KILN_DEVICE_CALL(gate.device(), swiglu_forward, out, gc, uc);
  if (any_requires_grad({gate, up})) {
    // Saves gate and up (with their versions), not silu(gate): one tensor less than the
    // composed silu and product keep.
    SavedTensor sg(gc), su(uc);
    record("swiglu", {gate, up}, out, [sg, su](const std::vector<Tensor>& g) {
      return detail::swiglu_grads(g[0].contiguous(), sg.get("swiglu"), su.get("swiglu"));
    });
  }
  return out;
}

// ---- rotary embedding ----

namespace {
Tensor rotate_half(const Tensor& x) {
  auto halves = split(x, x.size(-1) / 2, -1);
  return cat({neg(halves[1]), halves[0]}, -1);
}
}  // namespace

Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  check_defined(x, "rotary_embedding", "x");
  check_defined(cos, "rotary_embedding", "cos");
  check_defined(sin, "rotary_embedding", "sin");
  KILN_CHECK(is_floating(x.dtype()) && is_floating(cos.dtype()) && is_floating(sin.dtype()),
             "rotary_embedding: x, cos and sin must be floating, got ", dtype_name(x.dtype()), ", ",
             dtype_name(cos.dtype()), ", ", dtype_name(sin.dtype()));
  KILN_CHECK(x.dim() >= 2, "rotary_embedding: x must be [..., T, D], got shape ", x.shape());
  KILN_CHECK(cos.shape() == sin.shape(), "rotary_embedding: cos shape ", cos.shape(), " differs from sin shape ",
             sin.shape());
  check_same_device(x, cos, "rotary_embedding", "x", "cos");
  check_same_device(x, sin, "rotary_embedding", "x", "sin");
  const int64_t t = x.size(-2), d = x.size(-1);
  KILN_CHECK(d % 2 == 0, "rotary_embedding: head dim D must be even, got ", d, " (x shape ", x.shape(), ")");
  broadcast_shapes(x.shape(), cos.shape(), "rotary_embedding");
  // Fused path: tables that are [T, D] up to leading 1s and need no gradient.
  bool tables_td = cos.dim() >= 2 && cos.size(-2) == t && cos.size(-1) == d && cos.numel() == t * d;
  if (!tables_td || cos.requires_grad() || sin.requires_grad()) {
    Tensor c = cos.dtype() == x.dtype() ? cos : cos.to(x.dtype());
    Tensor s = sin.dtype() == x.dtype() ? sin : sin.to(x.dtype());
    return add(mul(x, c), mul(rotate_half(x), s));
  }
  Tensor c = cos.detach().to(DType::f32).contiguous().view({t, d});
  Tensor s = sin.detach().to(DType::f32).contiguous().view({t, d});
  // The kernels walk rows through their strides: only the head dim must be contiguous (q of
  // [B, T, H, D] seen as [B, H, T, D] is read in place). The gradient is laid out as x is, so
  // the transposes that made x undo into contiguous tensors without a copy.
  auto head_dim_contiguous = [](const Tensor& v) { return v.stride(-1) == 1 ? v : v.contiguous(); };
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() > 0) KILN_DEVICE_CALL(x.device(), rotary, out, head_dim_contiguous(x.detach()), c, s, false);
  // Saved with their versions: c and s alias f32 contiguous tables (cos.fill_(0) after the
  // forward gave dx 0 without a word; the composed path raised the version error).
  SavedTensor sc(c), ss(s);
  record("rotary_embedding", {x}, out, [sc, ss, head_dim_contiguous, layout = x.strides()](const std::vector<Tensor>& g) {
    Tensor dx = empty_in_layout(g[0].shape(), layout, g[0].dtype(), g[0].device());
    if (dx.stride(-1) != 1) dx = Tensor::empty(g[0].shape(), g[0].dtype(), g[0].device());
    if (dx.numel() > 0)
      KILN_DEVICE_CALL(dx.device(), rotary, dx, head_dim_contiguous(g[0]), sc.get("rotary_embedding"),
                       ss.get("rotary_embedding"), true);
    return std::vector<Tensor>{dx};
  });
  return out;
}

std::pair<Tensor, Tensor> rotary_tables(int64_t seq_len, int64_t head_dim, double theta, Device device) {
  KILN_CHECK(seq_len >= 0, "rotary_tables: seq_len must be >= 0, got ", seq_len);
  KILN_CHECK(head_dim > 0 && head_dim % 2 == 0, "rotary_tables: head_dim must be positive and even, got ", head_dim);
  KILN_CHECK(theta > 0 && std::isfinite(theta), "rotary_tables: theta must be positive, got ", theta);
  const int64_t half = head_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[static_cast<size_t>(i)] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  std::vector<float> c(static_cast<size_t>(seq_len * head_dim)), s(c.size());
  for (int64_t p = 0; p < seq_len; ++p)
    for (int64_t i = 0; i < half; ++i) {
      double f = static_cast<double>(p) * inv_freq[static_cast<size_t>(i)];
      size_t k = static_cast<size_t>(p * head_dim + i);
      c[k] = c[k + static_cast<size_t>(half)] = static_cast<float>(std::cos(f));
      s[k] = s[k + static_cast<size_t>(half)] = static_cast<float>(std::sin(f));
    }
  return {from_vector(c, {seq_len, head_dim}, device), from_vector(s, {seq_len, head_dim}, device)};
}

// ---- dropout ----

Tensor dropout(const Tensor& x, double p, Generator& gen, bool training) {
  check_defined(x, "dropout", "x");
  KILN_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got ", p);
  KILN_CHECK(is_floating(x.dtype()), "dropout: x must be floating, got ", dtype_name(x.dtype()));
  if (!training || p == 0.0) return x;
  Tensor keep = Tensor::empty(x.shape(), DType::boolean, x.device());
  uint64_t offset = gen.next_offset();
  if (keep.numel() > 0) KILN_DEVICE_CALL(x.device(), dropout_mask, keep, gen.seed, offset, p);
  // where + mul record the backward: the gradient flows through the same mask, scaled.
  return mul(where(keep, x, zeros({}, x.dtype(), x.device())), 1.0 / (1.0 - p));
}

}  // namespace kiln
