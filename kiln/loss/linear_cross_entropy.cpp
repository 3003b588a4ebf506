// The fused linear + cross-entropy front end: argument checks (errors name the offending
// index or value), the divisor, the kernel call, and the autograd node. When gradients are
// needed and the reduction is mean or sum, the kernel computes them inside the forward (as
// PyTorch 2.13's chunked loss does), so the first backward only scales them by grad_output;
// reduction none (and any later backward with retain_graph) recomputes them from the inputs.
#include "kiln/loss/linear_cross_entropy.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/lce.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/index_check.h"

namespace kiln {
namespace {

constexpr const char* kOp = "linear_cross_entropy";
constexpr const char* kReferenceOp = "linear_cross_entropy_reference";

// Everything the kernel needs besides the gradients, kept by the autograd node.
struct LceState {
  kernels::LceParams params;
  Tensor hidden, weight, bias, target, class_weight;  // contiguous, detached
  // Their versions at the forward: an in-place change before the backward is an error, as for
  // any saved tensor (a refilled target buffer changed dh without a word).
  std::vector<SavedTensor> versions;
  Shape hidden_shape, target_shape;
  bool weight_grad_f32 = false;
  Tensor grad_scale;  // mean without num_items: 1/divisor (zero divisor: 1 or NaN, below), f64 device scalar
  Tensor grad_hidden, grad_weight, grad_bias;  // computed in the forward (mean/sum), handed over once
  bool handed_over = false;
};

void check_same(const Tensor& t, const Tensor& ref, const char* name, const char* op) {
  KILN_CHECK(t.dtype() == ref.dtype(), op, ": ", name, " has dtype ", dtype_name(t.dtype()),
             ", expected hidden's dtype ", dtype_name(ref.dtype()));
  KILN_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device().str(), ", expected ",
             ref.device().str(), " (where hidden is)");
}

// `op` names the caller in the messages (the fused op or the reference).
void check_args(const Tensor& hidden, const Tensor& weight, const Tensor& target, const LinearCrossEntropyOptions& o,
                const char* op) {
  KILN_CHECK(hidden.defined() && weight.defined() && target.defined(), op, ": undefined tensor argument");
  KILN_CHECK(is_floating(hidden.dtype()), op, ": hidden must be floating, got ", dtype_name(hidden.dtype()));
  KILN_CHECK(hidden.dim() == 2 || hidden.dim() == 3, op, ": hidden must be [N, d] or [B, T, d], got ",
             hidden.shape());
  KILN_CHECK(weight.dim() == 2, op, ": weight must be [V, d], got ", weight.shape());
  KILN_CHECK(weight.size(1) == hidden.size(-1), op, ": weight is ", weight.shape(), " but hidden's last dim is ",
             hidden.size(-1), " (expected weight [V, ", hidden.size(-1), "])");
  KILN_CHECK(weight.size(0) > 0 && weight.size(1) > 0, op, ": weight must have V > 0 and d > 0, got ",
             weight.shape());
  check_same(weight, hidden, "weight", op);
  KILN_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32, op, ": target must be i64 or i32, got ",
             dtype_name(target.dtype()));
  KILN_CHECK(target.device() == hidden.device(), op, ": target is on ", target.device().str(), ", expected ",
             hidden.device().str());
  Shape expect(hidden.shape().begin(), hidden.shape().end() - 1);
  KILN_CHECK(target.shape() == expect, op, ": target has shape ", target.shape(), ", expected ", expect,
             " (hidden is ", hidden.shape(), ")");
  const int64_t v = weight.size(0);
  if (o.bias.defined()) {
    check_same(o.bias, hidden, "bias", op);
    KILN_CHECK(o.bias.dim() == 1 && o.bias.size(0) == v, op, ": bias must be [", v, "], got ", o.bias.shape());
  }
  if (o.weight.defined()) {
    check_same(o.weight, hidden, "weight (class weights)", op);
    KILN_CHECK(o.weight.dim() == 1 && o.weight.size(0) == v, op, ": class weights must be [", v, "], got ",
               o.weight.shape());
    KILN_CHECK(!(grad_enabled() && o.weight.requires_grad()), op,
               ": class weights that require grad are not supported (as in F.cross_entropy); detach them");
  }
  KILN_CHECK(std::isfinite(o.label_smoothing) && o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0, op,
             ": label_smoothing=", o.label_smoothing, " must be in [0, 1]");
  KILN_CHECK(std::isfinite(o.z_loss) && o.z_loss >= 0.0, op, ": z_loss=", o.z_loss, " must be finite and >= 0");
  // 16-bit and f32 inputs take z_loss and softcap as f32: past its range they became inf (a loss
  // of inf; a softcap of inf·tanh(x/inf) = NaN).
  const bool f32_math = compute_dtype(hidden.dtype()) == DType::f32;
  KILN_CHECK(!f32_math || o.z_loss <= std::numeric_limits<float>::max(), op, ": z_loss=", o.z_loss,
             " is past f32's range (the loss is computed in f32 for ", dtype_name(hidden.dtype()), " inputs)");
  check_reduction(o.reduction, op);
  KILN_CHECK(std::isfinite(o.softcap) && o.softcap >= 0.0, op, ": softcap=", o.softcap,
             " must be finite and >= 0 (0 turns it off)");
  KILN_CHECK(o.softcap == 0.0 || !f32_math || static_cast<float>(o.softcap) > 0.0f, op, ": softcap=", o.softcap,
             " rounds to 0 in f32, which would turn it off (0 turns it off)");
  KILN_CHECK(!f32_math || o.softcap <= std::numeric_limits<float>::max(), op, ": softcap=", o.softcap,
             " is past f32's range (the logits are capped in f32 for ", dtype_name(hidden.dtype()), " inputs)");
  KILN_CHECK(std::isfinite(o.num_items) && o.num_items >= 0.0, op, ": num_items=", o.num_items,
             " must be finite and > 0 (0: unset)");
  KILN_CHECK(o.num_items == 0.0 || std::isfinite(1.0 / o.num_items), op, ": num_items=", o.num_items,
             " is too small: its reciprocal overflows");
  KILN_CHECK(o.num_items == 0.0 || o.reduction != Reduction::none, op,
             ": num_items needs reduction mean or sum (got none)");
  KILN_CHECK(std::isfinite(o.filter_eps) && o.filter_eps >= 0.0, op, ": filter_eps=", o.filter_eps,
             " must be finite and >= 0");
  KILN_CHECK(o.chunk_tokens >= 0, op, ": chunk_tokens=", o.chunk_tokens, " must be >= 0");
  KILN_CHECK(o.dh_split >= 0, op, ": dh_split=", o.dh_split, " must be >= 0 (0 or 1: unsplit)");
  KILN_CHECK(o.dw_sms >= 0, op, ": dw_sms=", o.dw_sms, " must be >= 0 (0: off)");
}

// Checks every target against [0, V) ∪ {ignore_index} (on CUDA without a host synchronisation:
// a failure is raised at the next device-to-host copy, ops/index_check.h).
void check_targets(const Tensor& target, int64_t v, const LinearCrossEntropyOptions& o, const char* op) {
  detail::check_index_range(target, 0, v, o.ignore_index, std::string(op) + ": target",
                            " out of range [0, " + std::to_string(v) + ") (ignore_index is " +
                                std::to_string(o.ignore_index) + ")");
}

// The mean's divisor as f64 scalars on the target's device, computed there (no host sync): the
// count of non-ignored tokens and Σ w[target] over them (the count again without class
// weights). Out-of-range targets (reported by check_targets) count with a clamped index.
struct MeanDivisor {
  Tensor count, divisor;
};
MeanDivisor mean_divisor(const Tensor& target, int64_t v, const LinearCrossEntropyOptions& o) {
  const Device dev = target.device();
  const Tensor keep = detail::not_ignored(target, o.ignore_index);  // exact for any ignore_index
  Tensor count = sum(keep);
  if (!o.weight.defined()) return {count, count};
  Tensor idx = minimum(maximum(target, zeros({}, target.dtype(), dev)),
                       full({}, static_cast<double>(v - 1), target.dtype(), dev));
  Tensor wt = embedding(o.weight.detach().to(DType::f64).contiguous().view({v, 1}), idx).view({target.numel()});
  return {count, sum(mul(wt, keep))};
}

struct Rows {
  Tensor loss, zloss, lse;  // [N], accumulation dtype
};

// Runs the kernel over the state's inputs; gradients (when defined in `g`) are accumulated.
Rows run_kernel(const LceState& s, const kernels::LceParams& p, const Tensor& grad_scale, const Tensor& row_scale,
                const Tensor& gh, const Tensor& gw, const Tensor& gb) {
  const DType acc = compute_dtype(s.hidden.dtype());
  const Device dev = s.hidden.device();
  Rows r{Tensor::empty({p.n}, acc, dev), Tensor::empty({p.n}, acc, dev), Tensor::empty({p.n}, acc, dev)};
  kernels::LceTensors t;
  t.hidden = s.hidden;
  t.weight = s.weight;
  t.bias = s.bias;
  t.target = s.target;
  t.class_weight = s.class_weight;
  t.grad_scale = grad_scale;
  t.row_scale = row_scale;
  t.loss = r.loss;
  t.zloss = r.zloss;
  t.lse = r.lse;
  t.grad_hidden = gh;
  t.grad_weight = gw;
  t.grad_bias = gb;
  KILN_DEVICE_CALL(dev, linear_cross_entropy, p, t);
  return r;
}

struct Grads {
  Tensor h, w, b;
};

// Allocates the gradient buffers the backend writes (CPU: accumulation dtype; CUDA: the
// input dtype for d_hidden and d_weight — or f32 for d_weight when asked — and f32 for d_bias).
Grads alloc_grads(const LceState& s, bool need_h, bool need_w, bool need_b) {
  const DType in = s.hidden.dtype(), acc = compute_dtype(in);
  const Device dev = s.hidden.device();
  const bool cuda_dev = dev.is_cuda();
  Grads g;
  if (need_h) g.h = Tensor::empty({s.params.n, s.params.d}, cuda_dev ? in : acc, dev);
  if (need_w) g.w = zeros({s.params.v, s.params.d}, cuda_dev && !s.weight_grad_f32 ? in : acc, dev);
  if (need_b) g.b = zeros({s.params.v}, acc, dev);
  return g;
}

Tensor to_dtype(const Tensor& t, DType d) { return !t.defined() || t.dtype() == d ? t : t.to(d); }

// t *= go (grad_output, a scalar) in place. CUDA: on the device, a no-op when go is 1, without
// a host sync; CPU: reads go directly.
void scale_by(Tensor& t, const Tensor& go) {
  if (t.device().is_cuda()) {
    kernels::cuda::lce_scale(t, go.reshape({}).to(DType::f32).contiguous());
    return;
  }
  const double x = go.item();
  if (x != 1.0) mul_(t, x);
}

}  // namespace

void detail::check_linear_cross_entropy_args(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                                             const LinearCrossEntropyOptions& o) {
  check_args(hidden, weight, target, o, kReferenceOp);
  check_targets(target.contiguous(), weight.size(0), o, kReferenceOp);
}

LinearCrossEntropyResult linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                                              const LinearCrossEntropyOptions& o) {
  check_args(hidden, weight, target, o, kOp);
  check_device_available(hidden.device(), kOp);
  const int64_t d = hidden.size(-1), v = weight.size(0), n = target.numel();

  auto s = std::make_shared<LceState>();
  s->hidden = hidden.detach().reshape({n, d}).contiguous();
  s->weight = weight.detach().contiguous();
  if (o.bias.defined()) s->bias = o.bias.detach().contiguous();
  s->target = target.detach().reshape({n}).contiguous();
  check_targets(s->target, v, o, kOp);
  if (o.weight.defined()) s->class_weight = o.weight.detach().contiguous();
  for (const Tensor* t : {&s->hidden, &s->weight, &s->bias, &s->target, &s->class_weight}) s->versions.emplace_back(*t);
  s->hidden_shape = hidden.shape();
  s->target_shape = target.shape();
  s->weight_grad_f32 = o.weight_grad_f32;
  kernels::LceParams& p = s->params;
  p.n = n;
  p.d = d;
  p.v = v;
  p.ignore_index = o.ignore_index;
  p.label_smoothing = o.label_smoothing;
  p.z_loss = o.z_loss;
  p.softcap = o.softcap;
  p.class_weight_sum = o.weight.defined() ? sum(o.weight.detach().to(DType::f64)).item() : static_cast<double>(v);
  p.filter_eps = o.filter_eps;
  p.chunk_tokens = o.chunk_tokens;
  p.dh_split = o.dh_split;
  p.dw_sms = o.dw_sms;
  p.gemm_backend = o.gemm_backend;
  p.profile = o.profile;
  // The divisor of the summed loss: num_items, else Σ w[target] (mean; a device scalar, so that
  // no step waits for the device) or 1 (sum). A zero divisor makes the mean NaN, as in PyTorch;
  // its gradients stay 0 when every target is ignored (nothing contributes), and are NaN when
  // kept targets have class weights summing to 0 (PyTorch's 0 / 0; label smoothing and z-loss
  // still have gradients there, which the sum's scale would have passed as the mean's).
  const DType acc = compute_dtype(hidden.dtype());
  double divisor_h = 1.0;
  Tensor loss_scale;  // device divisor only: the mean's 1/divisor (NaN for 0), accumulation dtype
  if (o.num_items > 0.0) divisor_h = o.num_items;
  if (o.num_items == 0.0 && o.reduction == Reduction::mean) {
    NoGradGuard ng;
    const Device dev = hidden.device();
    const MeanDivisor md = mean_divisor(s->target, v, o);
    const Tensor zero = eq(md.divisor, zeros({}, DType::f64, dev));
    const Tensor inv = div(ones({}, DType::f64, dev), md.divisor);
    const Tensor none_kept = eq(md.count, zeros({}, DType::f64, dev));
    const Tensor nan = full({}, std::numeric_limits<double>::quiet_NaN(), DType::f64, dev);
    s->grad_scale = where(zero, where(none_kept, ones({}, DType::f64, dev), nan), inv);
    loss_scale = where(zero, nan, inv).to(acc);
    p.grad_scale = 1.0;
  } else {
    p.grad_scale = o.reduction == Reduction::none ? 1.0 : 1.0 / divisor_h;
  }

  std::vector<Tensor> inputs{hidden, weight};
  if (o.bias.defined()) inputs.push_back(o.bias);
  const bool need_h = hidden.requires_grad(), need_w = weight.requires_grad();
  const bool need_b = o.bias.defined() && o.bias.requires_grad();
  const bool any = any_requires_grad(inputs);
  const bool grads_in_forward = any && o.reduction != Reduction::none;

  Rows rows;
  {
    NoGradGuard ng;
    if (grads_in_forward) {
      Grads g = alloc_grads(*s, need_h, need_w, need_b);
      rows = run_kernel(*s, p, s->grad_scale, Tensor(), g.h, g.w, g.b);
      const DType in = hidden.dtype();
      s->grad_hidden = g.h.defined() ? to_dtype(g.h, in).view(s->hidden_shape) : Tensor();
      s->grad_weight = to_dtype(g.w, in);
      s->grad_bias = to_dtype(g.b, in);
    } else {
      rows = run_kernel(*s, p, s->grad_scale, Tensor(), Tensor(), Tensor(), Tensor());
    }
    p.profile = nullptr;  // the node may outlive the caller's profile object
  }

  LinearCrossEntropyResult res;
  {
    NoGradGuard ng;
    if (o.reduction == Reduction::none) {
      res.loss = rows.loss.to(hidden.dtype()).view(target.shape());
      res.z_loss = rows.zloss.to(hidden.dtype()).view(target.shape());
    } else {
      if (loss_scale.defined()) {
        res.loss = mul(sum(rows.loss), loss_scale).to(hidden.dtype());
        res.z_loss = mul(sum(rows.zloss), loss_scale).to(hidden.dtype());
      } else {
        res.loss = mul(sum(rows.loss), 1.0 / divisor_h).to(hidden.dtype());
        res.z_loss = mul(sum(rows.zloss), 1.0 / divisor_h).to(hidden.dtype());
      }
    }
    if (o.return_lse) res.lse = rows.lse.view(target.shape());
  }
  if (!any) return res;

  const bool none = o.reduction == Reduction::none;
  record(kOp, inputs, res.loss, [s, none, need_h, need_w, need_b](const std::vector<Tensor>& g) {
    for (const SavedTensor& t : s->versions) t.get(kOp);
    std::vector<Tensor> out(3);
    if (!none && !s->handed_over) {
      // Gradients were computed in the forward: scale them by grad_output and hand them over.
      s->handed_over = true;
      for (Tensor* t : {&s->grad_hidden, &s->grad_weight, &s->grad_bias})
        if (t->defined()) scale_by(*t, g[0]);
      out = {std::move(s->grad_hidden), std::move(s->grad_weight), std::move(s->grad_bias)};
      s->grad_hidden = s->grad_weight = s->grad_bias = Tensor();
    } else {
      // Recompute: reduction none (per-token grad_output) or a second backward.
      kernels::LceParams p = s->params;
      Tensor row_scale, grad_scale;
      if (none) {
        row_scale = g[0].reshape({p.n}).to(compute_dtype(s->hidden.dtype())).contiguous();
      } else {
        // grad_output stays on the device (no host sync): the kernel reads it as a scalar.
        grad_scale = g[0].reshape({}).to(DType::f64);
        if (s->grad_scale.defined()) grad_scale = mul(grad_scale, s->grad_scale);
        grad_scale = grad_scale.contiguous();
      }
      Grads gr = alloc_grads(*s, need_h, need_w, need_b);
      run_kernel(*s, p, grad_scale, row_scale, gr.h, gr.w, gr.b);
      const DType in = s->hidden.dtype();
      out = {gr.h.defined() ? to_dtype(gr.h, in).view(s->hidden_shape) : Tensor(), to_dtype(gr.w, in),
             to_dtype(gr.b, in)};
    }
    if (!s->bias.defined()) out.resize(2);
    return out;
  });
  return res;
}

}  // namespace kiln
