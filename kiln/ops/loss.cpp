// cross_entropy (the unfused reference loss, PyTorch semantics: ignore_index, reduction,
// label_smoothing) with a fused row kernel forward and backward, parse_reduction, and the
// ignore_index mask its mean shares with linear_cross_entropy (detail::not_ignored).
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/nn.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/index_check.h"
#include "kiln/ops/ops.h"

namespace kiln {

// ---- ignore_index mask (index_check.h) ----

Tensor detail::not_ignored(const Tensor& ids, int64_t ignore) {
  const Device dev = ids.device();
  const bool fits = ids.dtype() == DType::i64 ||
                    (ignore >= std::numeric_limits<int32_t>::min() && ignore <= std::numeric_limits<int32_t>::max());
  if (!fits) return ones(ids.shape(), DType::f64, dev);  // no i32 id equals it: nothing is ignored
  // Exact as an integer: past 2^53 through a double the value would round (a copy to the
  // device only then; full() needs none).
  constexpr int64_t kExactInDouble = int64_t{1} << 53;
  const Tensor value = ignore >= -kExactInDouble && ignore <= kExactInDouble
                           ? full({}, static_cast<double>(ignore), ids.dtype(), dev)
                           : from_vector(std::vector<int64_t>{ignore}, {}).to(dev);
  return ne(ids, value).to(DType::f64);
}

Reduction parse_reduction(const std::string& s) {
  if (s == "none") return Reduction::none;
  if (s == "mean") return Reduction::mean;
  if (s == "sum") return Reduction::sum;
  fail("parse_reduction: unknown reduction '", s, "' (expected none, mean or sum)");
}

void check_reduction(Reduction r, const char* op) {
  KILN_CHECK(r == Reduction::none || r == Reduction::mean || r == Reduction::sum, op, ": reduction=",
             static_cast<int>(r), " is not one of: none, mean, sum");
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& o) {
  KILN_CHECK(logits.defined() && target.defined(), "cross_entropy: undefined tensor argument");
  check_reduction(o.reduction, "cross_entropy");
  KILN_CHECK(logits.dim() == 2, "cross_entropy: logits must be 2-D [N, C], got shape ", logits.shape());
  KILN_CHECK(is_floating(logits.dtype()), "cross_entropy: logits must be floating, got ", dtype_name(logits.dtype()));
  KILN_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32,
             "cross_entropy: target must be i64 or i32, got ", dtype_name(target.dtype()));
  KILN_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "cross_entropy: target shape ", target.shape(),
             " does not match logits shape ", logits.shape(), " (expected [", logits.size(0), "])");
  KILN_CHECK(logits.device() == target.device(), "cross_entropy: device mismatch: logits are on ",
             logits.device().str(), ", target is on ", target.device().str());
  KILN_CHECK(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0,
             "cross_entropy: label_smoothing must be in [0, 1], got ", o.label_smoothing);
  const int64_t n = logits.size(0), c = logits.size(1);
  KILN_CHECK(c > 0 || n == 0, "cross_entropy: logits have 0 classes");
  Tensor tc = target.contiguous();
  detail::check_index_range(tc, 0, c, o.ignore_index, "cross_entropy: target",
                            " out of range [0, " + std::to_string(c) + ") (ignore_index=" +
                                std::to_string(o.ignore_index) + ")");
  const DType sd = compute_dtype(logits.dtype());
  Tensor lc = logits.detach().contiguous();
  Tensor rows = Tensor::empty({n}, sd, logits.device());
  Tensor lse = Tensor::empty({n}, sd, logits.device());
  Tensor out, count;
  {
    NoGradGuard ng;
    if (n > 0)
      KILN_DEVICE_CALL(lc.device(), cross_entropy_forward, rows, lse, lc, tc, o.ignore_index, o.label_smoothing);
    if (o.reduction == Reduction::mean)
      count = sum(detail::not_ignored(tc, o.ignore_index)).to(sd);
    if (o.reduction == Reduction::none) out = rows.to(logits.dtype());
    else if (o.reduction == Reduction::sum) out = sum(rows).to(logits.dtype());
    else out = div(sum(rows), count).to(logits.dtype());
    if (out.is_same(rows)) out = rows.detach();
  }
  if (any_requires_grad({logits})) {
    SavedTensor sl(lc), st(tc), se(lse);
    Reduction red = o.reduction;
    int64_t ignore = o.ignore_index;
    double ls = o.label_smoothing;
    record("cross_entropy", {logits}, out, [=](const std::vector<Tensor>& g) {
      Tensor gs = g[0].to(sd);
      Tensor scale = red == Reduction::none ? gs.contiguous()
                     : red == Reduction::sum ? gs.expand({n}).contiguous()
                                             : div(gs, count).expand({n}).contiguous();
      Tensor xl = sl.get("cross_entropy");
      Tensor dl = Tensor::empty(xl.shape(), xl.dtype(), xl.device());
      if (dl.numel() > 0)
        KILN_DEVICE_CALL(dl.device(), cross_entropy_backward, dl, scale, xl, st.get("cross_entropy"),
                         se.get("cross_entropy"), ignore, ls);
      return std::vector<Tensor>{dl};
    });
  }
  return out;
}

}  // namespace kiln
