// Reductions (sum, mean, amax, max with indices, argmax) and softmax/log_softmax, with
// autograd. Reduced dims are moved last and made contiguous, then reduced row by row.
#include <algorithm>
#include <numeric>

#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/reduce.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/ops.h"

namespace kiln {
namespace {

struct ReducePlan {
  std::vector<int64_t> dims;   // sorted, unique, non-negative
  Shape out_shape;             // without keepdim
  Shape keep_shape;            // with the reduced dims as 1
  int64_t rows = 1, cols = 1;
};

ReducePlan plan_reduce(const Tensor& a, const std::vector<int64_t>& dims_in, const char* op) {
  ReducePlan p;
  int64_t r = a.dim();
  // A 0-d tensor takes dim 0 (or -1) as PyTorch's: it is reduced over nothing.
  std::vector<bool> reduced(static_cast<size_t>(std::max<int64_t>(r, 1)), dims_in.empty());
  for (int64_t d : dims_in) {
    int64_t w = wrap_dim(d, r, op, true);
    KILN_CHECK(!reduced[static_cast<size_t>(w)], op, ": dim ", d, " given twice");
    reduced[static_cast<size_t>(w)] = true;
  }
  for (int64_t d = 0; d < r; ++d) {
    int64_t n = a.shape()[static_cast<size_t>(d)];
    if (reduced[static_cast<size_t>(d)]) {
      p.dims.push_back(d);
      p.keep_shape.push_back(1);
      p.cols *= n;
    } else {
      p.out_shape.push_back(n);
      p.keep_shape.push_back(n);
      p.rows *= n;
    }
  }
  return p;
}

// The input permuted so the reduced dims come last, as a contiguous [rows, cols] matrix.
Tensor rows_matrix(const Tensor& a, const ReducePlan& p) {
  std::vector<int64_t> perm;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (!std::binary_search(p.dims.begin(), p.dims.end(), d)) perm.push_back(d);
  perm.insert(perm.end(), p.dims.begin(), p.dims.end());
  return a.detach().permute(perm).contiguous().view({p.rows, p.cols});
}

Tensor reduce_raw(kernels::ReduceOp op, const Tensor& a, const ReducePlan& p) {
  Tensor out = Tensor::empty({p.rows}, a.dtype(), a.device());
  if (p.rows > 0) KILN_DEVICE_CALL(a.device(), reduce_rows, op, out, rows_matrix(a, p));
  return out;
}

}  // namespace

Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  KILN_CHECK(a.defined(), "sum: undefined tensor");
  ReducePlan p = plan_reduce(a, dims, "sum");
  // Integer and bool sums are i64, as in PyTorch (in the input's dtype, i32 or u8 counts wrapped).
  const Tensor src = is_floating(a.dtype()) || a.dtype() == DType::i64 ? a : a.to(DType::i64);
  Tensor y = reduce_raw(kernels::ReduceOp::sum, src, p).view(keepdim ? p.keep_shape : p.out_shape);
  Shape in_shape = a.shape(), keep = p.keep_shape;
  record("sum", {a}, y, [in_shape, keep](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].reshape(keep).expand(in_shape).contiguous()};
  });
  return y;
}

Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  KILN_CHECK(a.defined() && is_floating(a.dtype()), "mean: expected a floating tensor");
  ReducePlan p = plan_reduce(a, dims, "mean");
  // 16-bit inputs: the sum and its division in f32, one rounding at the end, as PyTorch (a sum
  // rounded to f16 first overflowed: the mean of 100 values of 1000 was inf).
  const double inv = 1.0 / static_cast<double>(p.cols);
  const DType math = compute_dtype(a.dtype());
  if (math != a.dtype()) return mul(sum(a.to(math), dims, keepdim), inv).to(a.dtype());
  return mul(sum(a, dims, keepdim), inv);
}

Tensor amax(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  KILN_CHECK(a.defined(), "amax: undefined tensor");
  ReducePlan p = plan_reduce(a, dims, "amax");
  KILN_CHECK(p.cols > 0 || p.rows == 0, "amax: cannot reduce over an empty dimension");
  Tensor y = reduce_raw(kernels::ReduceOp::max, a, p).view(keepdim ? p.keep_shape : p.out_shape);
  if (any_requires_grad({a})) {
    SavedTensor sa(a), sy(y);
    Shape keep = p.keep_shape;
    record("amax", {a}, y, [sa, sy, keep](const std::vector<Tensor>& g) {
      // Ties share the gradient equally, as PyTorch's amax does.
      Tensor x = sa.get("amax");
      Tensor hit = eq(x, sy.get("amax").reshape(keep)).to(x.dtype());
      // Per-output tie counts.
      std::vector<int64_t> rd;
      for (size_t i = 0; i < keep.size(); ++i)
        if (keep[i] == 1 && x.shape()[i] != 1) rd.push_back(static_cast<int64_t>(i));
      Tensor per = rd.empty() ? ones_like(g[0].reshape(keep)) : sum(hit, rd, true);
      return std::vector<Tensor>{mul(hit, div(g[0].reshape(keep), per))};
    });
  }
  return y;
}

ValuesIndices max(const Tensor& a, int64_t dim, bool keepdim) {
  KILN_CHECK(a.defined(), "max: undefined tensor");
  if (a.dim() == 0) {  // as PyTorch: the value itself and index 0
    wrap_dim(dim, 0, "max", true);
    return max(a.reshape({1}), 0, false);  // 0-d values and index, keepdim or not
  }
  ReducePlan p = plan_reduce(a, {dim}, "max");
  KILN_CHECK(p.cols > 0, "max: cannot reduce over an empty dimension");
  Tensor values = Tensor::empty({p.rows}, a.dtype(), a.device());
  Tensor indices = Tensor::empty({p.rows}, DType::i64, a.device());
  if (p.rows > 0) KILN_DEVICE_CALL(a.device(), max_rows_index, values, indices, rows_matrix(a, p));
  const Shape& s = keepdim ? p.keep_shape : p.out_shape;
  values = values.view(s);
  indices = indices.view(s);
  if (any_requires_grad({a})) {
    int64_t d = p.dims[0];
    Shape in_shape = a.shape(), keep = p.keep_shape;
    SavedTensor sidx(indices.reshape(keep));  // indices.fill_(0) before the backward moved the gradient
    record("max", {a}, values, [d, in_shape, keep, sidx](const std::vector<Tensor>& g) {
      const Tensor idx = sidx.get("max");
      // Scatter the gradient to the arg-max positions: one-hot along d.
      Tensor pos = arange(in_shape[static_cast<size_t>(d)], DType::i64, g[0].device());
      Shape view_shape(in_shape.size(), 1);
      view_shape[static_cast<size_t>(d)] = in_shape[static_cast<size_t>(d)];
      Tensor hit = eq(pos.view(view_shape).expand(in_shape), idx.expand(in_shape));
      return std::vector<Tensor>{where(hit, g[0].reshape(keep).expand(in_shape), zeros({}, g[0].dtype(), g[0].device()))};
    });
  }
  return {values, indices};
}

Tensor argmax(const Tensor& a, int64_t dim, bool keepdim) { return max(a.detach(), dim, keepdim).indices; }

// softmax and log_softmax of 16-bit inputs compute in f32 and round once (as PyTorch): in f16
// the row sum of 70000 ones overflowed (every softmax 0, log_softmax -inf), and bf16 rows
// summed short (3000 zeros: 0.9956). Their backward takes the saved 16-bit output the same way.
Tensor softmax(const Tensor& a, int64_t dim) {
  KILN_CHECK(a.defined() && is_floating(a.dtype()), "softmax: expected a floating tensor");
  wrap_dim(dim, a.dim(), "softmax", true);
  if (a.numel() == 0) return a.clone();  // an empty dim: an empty result, as PyTorch
  const DType dt = a.dtype(), math = compute_dtype(dt);
  Tensor x = a.detach().to(math);
  Tensor e = exp(sub(x, amax(x, {dim}, true)));
  Tensor y = div(e, sum(e, {dim}, true)).to(dt);
  if (any_requires_grad({a})) {
    SavedTensor sy(y);
    record("softmax", {a}, y, [sy, dim, math](const std::vector<Tensor>& g) {
      Tensor yy = sy.get("softmax").to(math);
      Tensor gy = mul(g[0].to(math), yy);
      return std::vector<Tensor>{sub(gy, mul(yy, sum(gy, {dim}, true))).to(g[0].dtype())};
    });
  }
  return y;
}

Tensor log_softmax(const Tensor& a, int64_t dim) {
  KILN_CHECK(a.defined() && is_floating(a.dtype()), "log_softmax: expected a floating tensor");
  wrap_dim(dim, a.dim(), "log_softmax", true);
  if (a.numel() == 0) return a.clone();  // an empty dim: an empty result, as PyTorch
  const DType dt = a.dtype(), math = compute_dtype(dt);
  Tensor x = a.detach().to(math);
  Tensor shifted = sub(x, amax(x, {dim}, true));
  Tensor y = sub(shifted, log(sum(exp(shifted), {dim}, true))).to(dt);
  if (any_requires_grad({a})) {
    SavedTensor sy(y);
    record("log_softmax", {a}, y, [sy, dim, math](const std::vector<Tensor>& g) {
      Tensor yy = sy.get("log_softmax").to(math), gm = g[0].to(math);
      return std::vector<Tensor>{sub(gm, mul(exp(yy), sum(gm, {dim}, true))).to(g[0].dtype())};
    });
  }
  return y;
}

}  // namespace kiln
