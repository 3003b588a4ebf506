// cat, stack and split, built on views and copies so they work on every device.
#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/ops.h"

namespace kiln {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  KILN_CHECK(!tensors.empty(), "cat: expected at least one tensor");
  const Tensor& t0 = tensors[0];
  KILN_CHECK(t0.defined() && t0.dim() > 0, "cat: tensors must have at least one dim");
  const int64_t d = wrap_dim(dim, t0.dim(), "cat");
  Shape out_shape = t0.shape();
  out_shape[static_cast<size_t>(d)] = 0;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    KILN_CHECK(t.defined() && t.dim() == t0.dim(), "cat: tensor ", i, " has rank ", t.defined() ? t.dim() : -1,
               ", tensor 0 has rank ", t0.dim());
    KILN_CHECK(t.dtype() == t0.dtype() && t.device() == t0.device(), "cat: tensor ", i, " is ", dtype_name(t.dtype()),
               " on ", t.device().str(), ", tensor 0 is ", dtype_name(t0.dtype()), " on ", t0.device().str());
    for (int64_t k = 0; k < t0.dim(); ++k)
      KILN_CHECK(k == d || t.shape()[static_cast<size_t>(k)] == t0.shape()[static_cast<size_t>(k)], "cat: tensor ", i,
                 " has shape ", t.shape(), ", which differs from tensor 0's ", t0.shape(), " outside dim ", d);
    sizes.push_back(t.shape()[static_cast<size_t>(d)]);
    out_shape[static_cast<size_t>(d)] += sizes.back();
  }
  Tensor out = Tensor::empty(out_shape, t0.dtype(), t0.device());
  {
    NoGradGuard ng;
    int64_t off = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      out.narrow(d, off, sizes[i]).copy_(tensors[i]);
      off += sizes[i];
    }
  }
  record("cat", tensors, out, [sizes, d](const std::vector<Tensor>& g) {
    std::vector<Tensor> parts = split(g[0], sizes, d);
    return parts;
  });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  KILN_CHECK(!tensors.empty(), "stack: expected at least one tensor");
  KILN_CHECK(tensors[0].defined(), "stack: tensor 0 is undefined");
  const int64_t d = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> u;
  u.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    KILN_CHECK(tensors[i].defined() && tensors[i].shape() == tensors[0].shape(), "stack: tensor ", i, " has shape ",
               tensors[i].defined() ? tensors[i].shape() : Shape{}, ", tensor 0 has ", tensors[0].shape());
    u.push_back(tensors[i].unsqueeze(d));
  }
  return cat(u, d);
}

std::vector<Tensor> split(const Tensor& a, const std::vector<int64_t>& sizes, int64_t dim) {
  KILN_CHECK(a.defined() && a.dim() > 0, "split: expected a tensor with at least one dim");
  const int64_t d = wrap_dim(dim, a.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    KILN_CHECK(s >= 0, "split: negative size ", s);
    total += s;
  }
  KILN_CHECK(total == a.size(d), "split: sizes ", sizes, " sum to ", total, ", but dim ", d, " has size ", a.size(d));
  std::vector<Tensor> out;
  int64_t off = 0;
  for (int64_t s : sizes) {
    out.push_back(a.narrow(d, off, s));
    off += s;
  }
  return out;
}

std::vector<Tensor> split(const Tensor& a, int64_t split_size, int64_t dim) {
  KILN_CHECK(split_size > 0, "split: split_size must be positive, got ", split_size);
  KILN_CHECK(a.defined() && a.dim() > 0, "split: expected a tensor with at least one dim");
  const int64_t n = a.shape()[static_cast<size_t>(wrap_dim(dim, a.dim(), "split"))];
  std::vector<int64_t> sizes;
  for (int64_t left = n; left > 0; left -= sizes.back()) sizes.push_back(std::min(split_size, left));
  if (n == 0) sizes.push_back(0);  // as PyTorch: an empty dim splits into one empty part
  return split(a, sizes, dim);
}

}  // namespace kiln
