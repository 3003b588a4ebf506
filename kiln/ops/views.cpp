// View ops: new layouts over the same storage, recorded by autograd. The backward of a view
// that selects elements (slice, narrow, select) scatters the gradient into zeros of the
// input's shape through the same view.
#include <algorithm>
#include <functional>
#include <numeric>

#include "kiln/ops/backward.h"
#include "kiln/ops/ops.h"

namespace kiln {
namespace {

Tensor make_view(const Tensor& base, Shape shape, Strides strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

// Records a view whose gradient is scattered through `apply` into zeros of the input shape.
void record_selecting_view(const char* op, const Tensor& input, Tensor& out, std::function<Tensor(const Tensor&)> apply) {
  Shape in_shape = input.shape();
  record(op, {input}, out, [in_shape, apply](const std::vector<Tensor>& g) {
    Tensor gi = zeros(in_shape, g[0].dtype(), g[0].device());
    apply(gi).copy_(g[0]);
    return std::vector<Tensor>{gi};
  });
}

// Strides for viewing a tensor of (shape, strides) as new_shape, if possible without a copy.
std::optional<Strides> view_strides(const Shape& shape, const Strides& strides, const Shape& new_shape) {
  // Empty or one-element tensors (incl. 0-dim scalars) can take any shape.
  if (shape_numel(shape) <= 1) return contiguous_strides(new_shape);
  // Group old dims into contiguous chunks, then map new dims onto them (as ATen computeStride).
  Strides out(new_shape.size());
  int64_t view_d = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t chunk_base_stride = strides.empty() ? 1 : strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= shape[static_cast<size_t>(d)];
    if (d == 0 || (shape[static_cast<size_t>(d - 1)] != 1 &&
                   strides[static_cast<size_t>(d - 1)] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[static_cast<size_t>(view_d)] == 1)) {
        out[static_cast<size_t>(view_d)] = view_numel * chunk_base_stride;
        view_numel *= new_shape[static_cast<size_t>(view_d)];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = strides[static_cast<size_t>(d - 1)];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

Shape infer_shape(const Shape& requested, int64_t numel, const char* op) {
  Shape s = requested;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      KILN_CHECK(infer < 0, op, ": only one dimension can be -1 in ", requested);
      infer = static_cast<int64_t>(i);
    } else {
      KILN_CHECK(s[i] >= 0, op, ": invalid dimension ", s[i], " in ", requested);
      known *= s[i];
    }
  }
  if (infer >= 0) {
    KILN_CHECK(known != 0 && numel % known == 0, op, ": shape ", requested, " is invalid for ", numel, " elements");
    s[static_cast<size_t>(infer)] = numel / known;
  }
  KILN_CHECK(shape_numel(s) == numel, op, ": shape ", requested, " is invalid for input of ", numel, " elements");
  return s;
}

}  // namespace

Tensor Tensor::view(const Shape& shape_req) const {
  Shape s = infer_shape(shape_req, numel(), "view");
  auto st = view_strides(shape(), strides(), s);
  KILN_CHECK(st.has_value(), "view: shape ", shape_req, " is not compatible with the input's strides ", strides(),
             " (shape ", shape(), "); use reshape()");
  Tensor out = make_view(*this, s, *st, offset());
  Shape in_shape = shape();
  record("view", {*this}, out, [in_shape](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].reshape(in_shape)};
  });
  return out;
}

Tensor Tensor::reshape(const Shape& shape_req) const {
  Shape s = infer_shape(shape_req, numel(), "reshape");
  if (view_strides(shape(), strides(), s)) return view(s);
  return contiguous().view(s);
}

Tensor Tensor::flatten(int64_t start, int64_t end) const {
  if (dim() == 0) return reshape({1});
  int64_t s = wrap_dim(start, dim(), "flatten"), e = wrap_dim(end, dim(), "flatten");
  KILN_CHECK(s <= e, "flatten: start dim ", start, " after end dim ", end);
  Shape ns(shape().begin(), shape().begin() + s);
  int64_t m = 1;
  for (int64_t d = s; d <= e; ++d) m *= shape()[static_cast<size_t>(d)];
  ns.push_back(m);
  ns.insert(ns.end(), shape().begin() + e + 1, shape().end());
  return reshape(ns);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  int64_t w = wrap_dim(d, dim(), "slice");
  KILN_CHECK(step > 0, "slice: step must be positive, got ", step);
  int64_t n = shape()[static_cast<size_t>(w)];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape s = shape();
  Strides st = strides();
  s[static_cast<size_t>(w)] = end == start ? 0 : (end - start - 1) / step + 1;  // no overflow for a huge step
  int64_t off = offset() + start * st[static_cast<size_t>(w)];
  st[static_cast<size_t>(w)] *= step;
  Tensor out = make_view(*this, s, st, off);
  record_selecting_view("slice", *this, out, [w, start, end, step](const Tensor& t) { return t.slice(w, start, end, step); });
  return out;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  int64_t w = wrap_dim(d, dim(), "narrow");
  int64_t n = shape()[static_cast<size_t>(w)];
  // As torch: start in [-n, n], a negative one counted from the end.
  const int64_t s0 = start < 0 ? start + n : start;
  KILN_CHECK(start >= -n && start <= n, "narrow: start ", start, " out of range [", -n, ", ", n, "] for dim ", d,
             " of size ", n);
  KILN_CHECK(length >= 0 && length <= n - s0, "narrow: start ", start,
             start < 0 ? " (" + std::to_string(s0) + " from the front)" : std::string(), " + length ", length,
             " exceeds size ", n, " of dim ", d, " (length must be >= 0)");
  return slice(w, s0, s0 + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  int64_t w = wrap_dim(d, dim(), "select");
  int64_t n = shape()[static_cast<size_t>(w)];
  int64_t i = index < 0 ? index + n : index;
  KILN_CHECK(i >= 0 && i < n, "select: index ", index, " out of range for dim ", d, " of size ", n);
  Shape s = shape();
  Strides st = strides();
  int64_t off = offset() + i * st[static_cast<size_t>(w)];
  s.erase(s.begin() + w);
  st.erase(st.begin() + w);
  Tensor out = make_view(*this, s, st, off);
  record_selecting_view("select", *this, out, [w, i](const Tensor& t) { return t.select(w, i); });
  return out;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  const int64_t w0 = wrap_dim(d0, dim(), "transpose", true), w1 = wrap_dim(d1, dim(), "transpose", true);
  if (dim() == 0) return *this;
  std::vector<int64_t> perm(static_cast<size_t>(dim()));
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[static_cast<size_t>(w0)], perm[static_cast<size_t>(w1)]);
  return permute(perm);
}

Tensor Tensor::t() const {
  KILN_CHECK(dim() <= 2, "t: expects a tensor of at most 2 dims, got shape ", shape(), " (use transpose(d0, d1))");
  return dim() < 2 ? *this : transpose(0, 1);
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  KILN_CHECK(static_cast<int64_t>(dims.size()) == dim(), "permute: ", dims.size(), " dims given for a tensor of rank ", dim());
  Shape s(dims.size());
  Strides st(dims.size());
  std::vector<int64_t> inverse(dims.size(), -1);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t w = wrap_dim(dims[i], dim(), "permute");
    KILN_CHECK(inverse[static_cast<size_t>(w)] < 0, "permute: dim ", dims[i], " repeated in ", dims);
    inverse[static_cast<size_t>(w)] = static_cast<int64_t>(i);
    s[i] = shape()[static_cast<size_t>(w)];
    st[i] = strides()[static_cast<size_t>(w)];
  }
  Tensor out = make_view(*this, s, st, offset());
  record("permute", {*this}, out, [inverse](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].permute(inverse)};
  });
  return out;
}

Tensor Tensor::expand(const Shape& target) const {
  KILN_CHECK(target.size() >= shape().size(), "expand: target ", target, " has fewer dims than the input ", shape());
  size_t lead = target.size() - shape().size();
  Shape s(target.size());
  Strides st(target.size(), 0);
  for (size_t i = 0; i < target.size(); ++i) {
    if (i < lead) {
      KILN_CHECK(target[i] >= 0, "expand: cannot use -1 for a new leading dim in ", target);
      s[i] = target[i];
      continue;
    }
    int64_t have = shape()[i - lead];
    KILN_CHECK(target[i] >= -1, "expand: size ", target[i], " of dim ", i, " in ", target,
               " is negative (-1 keeps the input's size)");
    int64_t want = target[i] == -1 ? have : target[i];
    if (have == want) {
      s[i] = have;
      st[i] = strides()[i - lead];
    } else {
      KILN_CHECK(have == 1, "expand: the size of dim ", i - lead, " (", have, ") must be 1 to expand to ", want,
                 " (input ", shape(), ", target ", target, ")");
      s[i] = want;
    }
  }
  Tensor out = make_view(*this, s, st, offset());
  Shape in_shape = shape();
  record("expand", {*this}, out, [in_shape](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{sum_to(g[0], in_shape)};
  });
  return out;
}

Tensor Tensor::squeeze(int64_t d) const {
  int64_t w = wrap_dim(d, dim(), "squeeze", true);
  if (dim() == 0 || shape()[static_cast<size_t>(w)] != 1) return *this;
  Shape s = shape();
  s.erase(s.begin() + w);
  return view(s);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  int64_t w = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape s = shape();
  s.insert(s.begin() + w, 1);
  return view(s);
}

}  // namespace kiln
