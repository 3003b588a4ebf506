// Copies and conversions: contiguous, clone, to(dtype), to(device), the in-place copy_/fill_
// (which bump the version counter and are refused on leaves that require grad), and the
// in-place guards (check_inplace, check_inplace_source).
#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/inplace.h"
#include "kiln/ops/ops.h"

namespace kiln {

void check_inplace(const Tensor& t, const char* op) {
  KILN_CHECK(!(grad_enabled() && t.requires_grad() && t.is_leaf()), op,
             ": a leaf tensor that requires grad is being used in an in-place operation "
             "(wrap it in NoGradGuard, or use a copy)");
  KILN_CHECK(!(grad_enabled() && t.requires_grad()), op,
             ": in-place operations on tensors that are part of an autograd graph are not supported; "
             "use the out-of-place op");
  t.bump_version();
}

void check_inplace_source(const Tensor& src, const char* op) {
  KILN_CHECK(!(grad_enabled() && src.requires_grad()), op, ": the source requires grad, and ", op,
             " records no autograd history, so its gradient would be lost; pass src.detach(), or build the tensor "
             "with ops that record it (add, cat, where, ...)");
}

Tensor Tensor::clone() const {
  Tensor out = Tensor::empty(shape(), dtype(), device());
  KILN_DEVICE_CALL(device(), copy, out, *this);
  record("clone", {*this}, out, [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0]}; });
  return out;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::to(DType target) const {
  if (target == dtype()) return *this;
  Tensor out = Tensor::empty(shape(), target, device());
  KILN_DEVICE_CALL(device(), copy, out, *this);
  if (is_floating(target)) {
    DType source = dtype();
    record("to_dtype", {*this}, out, [source](const std::vector<Tensor>& g) {
      return std::vector<Tensor>{g[0].to(source)};
    });
  }
  return out;
}

Tensor Tensor::to(Device target) const {
  if (target == device()) return *this;
  check_device_available(target, "to");
  Tensor src = contiguous();
  Tensor out = Tensor::empty(shape(), dtype(), target);
  if (numel() > 0) {  // CUDA's own entry points (kernels/copy.h; a build without CUDA never gets here)
    profile::Scope ps(device().is_cpu() ? "copy_host_to_device" : target.is_cpu() ? "copy_device_to_host"
                                                                                   : "copy_device_to_device",
                      device().is_cpu() ? target : device());
    if (device().is_cpu()) kernels::cuda::copy_host_to_device(out.data_ptr(), src.data_ptr(), nbytes(), target.index);
    else if (target.is_cpu()) kernels::cuda::copy_device_to_host(out.data_ptr(), src.data_ptr(), nbytes(), device().index);
    else kernels::cuda::copy_device_to_device(out.data_ptr(), target.index, src.data_ptr(), device().index, nbytes());
  }
  Device source = device();
  record("to_device", {*this}, out, [source](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].to(source)};
  });
  return out;
}

Tensor& Tensor::copy_(const Tensor& src) {
  KILN_CHECK(src.defined(), "copy_: source is undefined");
  check_inplace_source(src, "copy_");
  check_inplace(*this, "copy_");
  Tensor s = src;
  if (s.device() != device()) s = s.to(device());
  if (s.shape() != shape()) s = s.expand(shape());
  KILN_DEVICE_CALL(device(), copy, *this, s);
  return *this;
}

namespace {
// The pair as one block of rows, when both sides are contiguous or 2-D with contiguous rows.
bool as_copy_block(const Tensor& d, const Tensor& s, kernels::CopyBlock& b) {
  const auto item = static_cast<int64_t>(itemsize(d.dtype()));
  if (d.is_contiguous() && s.is_contiguous()) {
    b = {d.data_ptr(), s.data_ptr(), 1, d.numel() * item, d.numel() * item, d.numel() * item};
    return true;
  }
  if (d.dim() == 2 && s.dim() == 2 && d.strides()[1] == 1 && s.strides()[1] == 1 && d.strides()[0] >= d.shape()[1] &&
      s.strides()[0] >= s.shape()[1]) {
    b = {d.data_ptr(), s.data_ptr(), d.shape()[0], d.shape()[1] * item, d.strides()[0] * item, s.strides()[0] * item};
    return true;
  }
  return false;
}
}  // namespace

void copy_many(const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs) {
  KILN_CHECK(dsts.size() == srcs.size(), "copy_many: ", dsts.size(), " destinations and ", srcs.size(), " sources");
  std::vector<kernels::CopyBlock> blocks;
  Device device = kCPU;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const Tensor &d = dsts[i], &s = srcs[i];
    KILN_CHECK(d.defined() && s.defined(), "copy_many: pair ", i, " has an undefined tensor");
    KILN_CHECK(d.shape() == s.shape(), "copy_many: pair ", i, ": shapes ", d.shape(), " and ", s.shape(), " differ");
    kernels::CopyBlock b;
    const bool batched = d.dtype() == s.dtype() && d.device() == s.device() && d.data_ptr() != s.data_ptr() &&
                         (blocks.empty() || d.device() == device) && as_copy_block(d, s, b);
    if (!batched) {
      Tensor(d).copy_(s);
      continue;
    }
    check_inplace_source(s, "copy_many");
    check_inplace(d, "copy_many");
    if (d.numel() == 0) continue;
    device = d.device();
    blocks.push_back(b);
  }
  if (!blocks.empty()) KILN_DEVICE_CALL(device, copy_blocks, device, blocks);
}

Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_");
  check_value_fits(value, dtype(), "fill_");
  KILN_DEVICE_CALL(device(), fill, *this, value);
  return *this;
}

}  // namespace kiln
