// linear_cross_entropy_reference: the unfused loss composed from core ops, differentiable
// through their autograd: linear + kiln::cross_entropy when the options are ones cross_entropy
// has; otherwise linear, tanh, log-sum-exp, one-hot masks and sums. It materialises
// the N × V logits (and a few N × V temporaries): the baseline the fused op is measured and
// tested against, in any floating dtype including f64. Options mean what they mean for the
// fused op (kiln/loss/linear_cross_entropy.h); the formulas are in docs/loss.md.
#include <limits>

#include "kiln/autograd/grad_mode.h"
#include "kiln/loss/linear_cross_entropy.h"

namespace kiln {

LinearCrossEntropyResult linear_cross_entropy_reference(const Tensor& hidden, const Tensor& weight,
                                                        const Tensor& target, const LinearCrossEntropyOptions& o) {
  detail::check_linear_cross_entropy_args(hidden, weight, target, o);
  const int64_t d = hidden.size(-1), v = weight.size(0), n = target.numel();
  const DType in = hidden.dtype();
  const DType acc = compute_dtype(in);
  if (o.softcap == 0.0 && o.z_loss == 0.0 && !o.weight.defined() && o.num_items == 0.0) {
    // What the core ops do directly: linear, then kiln::cross_entropy on the logits.
    Tensor logits = linear(hidden.reshape({n, d}), weight, o.bias);
    CrossEntropyOptions ce;
    ce.ignore_index = o.ignore_index;
    ce.reduction = o.reduction;
    ce.label_smoothing = o.label_smoothing;
    LinearCrossEntropyResult r;
    r.loss = cross_entropy(logits, target.reshape({n}), ce);
    if (o.reduction == Reduction::none) r.loss = r.loss.view(target.shape());
    NoGradGuard ng;
    r.z_loss = zeros(r.loss.shape(), in, hidden.device());
    if (o.return_lse) {
      Tensor z = logits.detach().to(acc);
      Tensor m = amax(z, {1}, true);
      r.lse = add(log(sum(exp(sub(z, m)), {1})), m.view({n})).view(target.shape());
    }
    return r;
  }
  Tensor logits = linear(hidden.reshape({n, d}), weight, o.bias);  // [N, V] in the input dtype
  Tensor z = logits.to(acc);
  if (o.softcap > 0.0) z = mul(tanh(mul(z, 1.0 / o.softcap)), o.softcap);
  Tensor m = amax(z.detach(), {1}, true);
  Tensor lse = add(log(sum(exp(sub(z, m)), {1})), m.view({n}));  // [N]
  Tensor logp = sub(z, lse.view({n, 1}));
  Tensor t64 = target.reshape({n}).to(DType::i64);
  Tensor valid = ne(t64, full({n}, static_cast<double>(o.ignore_index), DType::i64, hidden.device())).to(acc);
  // One-hot of the target, zero on ignored rows (ignore_index may be a valid class id).
  Tensor onehot = mul(eq(arange(v, DType::i64, hidden.device()).view({1, v}), t64.view({n, 1})).to(acc), valid.view({n, 1}));
  Tensor cw = o.weight.defined() ? o.weight.detach().to(acc).view({1, v}) : Tensor();
  Tensor wt_onehot = cw.defined() ? mul(onehot, cw) : onehot;  // w[t] at the target, 0 elsewhere
  Tensor ce = mul(sum(mul(logp, wt_onehot), {1}), -(1.0 - o.label_smoothing));
  if (o.label_smoothing > 0.0) {
    Tensor wl = cw.defined() ? mul(logp, cw) : logp;
    ce = add(ce, mul(mul(sum(wl, {1}), valid), -o.label_smoothing / static_cast<double>(v)));
  }
  Tensor zl = mul(mul(mul(lse, lse), valid), o.z_loss);
  Tensor loss_rows = add(ce, zl);
  LinearCrossEntropyResult r;
  if (o.reduction == Reduction::none) {
    r.loss = loss_rows.to(in).view(target.shape());
    NoGradGuard ng;
    r.z_loss = zl.to(in).view(target.shape());
  } else {
    double div = 1.0;
    if (o.num_items > 0.0) div = o.num_items;
    else if (o.reduction == Reduction::mean) div = sum(sum(wt_onehot, {1}).to(DType::f64)).item();
    const double scale = div == 0.0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / div;
    r.loss = mul(sum(loss_rows), scale).to(in);
    NoGradGuard ng;
    r.z_loss = mul(sum(zl.detach()), scale).to(in);
  }
  if (o.return_lse) r.lse = lse.detach().view(target.shape());
  return r;
}

}  // namespace kiln
