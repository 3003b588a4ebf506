// The Optimizer's step: gradient checks, then either the multi-tensor path (one call per device
// over every parameter that has a gradient, the clip folded in: NOTE [multi-tensor step] in
// kernels/optim.h) or the per-parameter reference (clip_grad_norm_, then one update() per
// parameter); the clip by a norm computed here (clip_and_step) or given (step_with_norm).
#include <cmath>

#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/optim.h"
#include "kiln/ops/ops.h"
#include "kiln/optim/clip.h"
#include "kiln/optim/optimizer.h"

namespace kiln::optim {

void Optimizer::step() { run_step(Clip{}); }

double Optimizer::clip_and_step(double max_norm, double norm_type) {
  KILN_CHECK(!std::isnan(max_norm) && max_norm >= 0.0, kind_, " clip_and_step: max_norm=", max_norm,
             " must be >= 0 (or inf)");
  KILN_CHECK(norm_type > 0.0 && !std::isnan(norm_type), kind_, " clip_and_step: norm_type=", norm_type,
             " must be > 0 (or inf)");
  return run_step(Clip{true, max_norm, norm_type, false, 0.0});
}

bool Optimizer::step_with_norm(double total_norm, double max_norm) {
  KILN_CHECK(!std::isnan(max_norm) && max_norm >= 0.0, kind_, " step_with_norm: max_norm=", max_norm,
             " must be >= 0 (or inf)");
  KILN_CHECK(std::isnan(total_norm) || total_norm >= 0.0, kind_, " step_with_norm: total_norm=", total_norm,
             " must be >= 0 (or non-finite: the step is skipped)");
  return std::isfinite(run_step(Clip{true, max_norm, 2.0, true, total_norm}));
}

void Optimizer::ensure_buffers(size_t i) {
  ParamState& st = state_[i];
  if (st.step != 0) return;
  const Tensor& p = params_[i].second;
  st.buffers.clear();
  for (size_t k = 0; k < buffer_names_.size(); ++k) st.buffers.push_back(zeros(p.shape(), DType::f32, p.device()));
}

Tensor Optimizer::checked_grad(size_t i) const {
  const char* op = kind_.c_str();
  const auto& [name, p] = params_[i];
  Tensor g = p.grad();
  if (!g.defined()) return g;
  KILN_CHECK(g.shape() == p.shape(), op, ": gradient of '", name, "' has shape ", g.shape(), ", parameter has ",
             p.shape());
  KILN_CHECK(g.device() == p.device(), op, ": gradient of '", name, "' is on ", g.device().str(), ", parameter on ",
             p.device().str());
  KILN_CHECK(g.dtype() == DType::f32 || g.dtype() == DType::bf16, op, ": gradient of '", name, "' has dtype ",
             dtype_name(g.dtype()), " (expected f32 or bf16)");
  return g.is_contiguous() ? g.detach() : g.detach().contiguous();
}

double Optimizer::run_step(const Clip& clip) {
  NoGradGuard no_grad;
  // Check every gradient before touching anything, so a bad one leaves all parameters as they were.
  std::vector<Tensor> grads(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) grads[i] = checked_grad(i);
  return multi_tensor_ ? run_step_multi_tensor(grads, clip) : run_step_per_parameter(grads, clip);
}

void Optimizer::step_parameter(size_t i) {
  KILN_CHECK(i < params_.size(), kind_, " step_parameter: index ", i, " past the last of ", params_.size(),
             " parameters");
  NoGradGuard no_grad;
  if (const Tensor g = checked_grad(i); g.defined()) update_one(i, g);
}

void Optimizer::update_one(size_t i, const Tensor& grad) {
  const Tensor& p = params_[i].second;
  ParamState& st = state_[i];
  Tensor work = p.is_contiguous() ? p.detach() : p.detach().contiguous();
  ensure_buffers(i);
  const int64_t t = st.step + 1;
  update(work, grad, st.buffers, decay_[i] ? weight_decay_ : 0.0, t);
  st.step = t;
  if (p.is_contiguous()) p.bump_version();
  else p.detach().copy_(work);
}

double Optimizer::run_step_per_parameter(const std::vector<Tensor>& checked, const Clip& clip) {
  std::vector<Tensor> grads = checked;
  double norm = 0.0;
  if (clip.on && clip.given) {
    // As clip_grad_norm_ scales, with the given norm.
    norm = clip.norm;
    if (!std::isfinite(norm)) return norm;
    const double scale = kernels::clip_scale(norm, clip.max_norm);
    if (scale < 1.0)
      for (auto& [name, p] : params_)
        if (Tensor g = p.grad(); g.defined()) mul_(g, scale);
  } else if (clip.on) {
    norm = clip_grad_norm_(params_, clip.max_norm, {clip.norm_type, false});
    if (!std::isfinite(norm)) return norm;
  }
  if (clip.on) {
    // The clip scaled the gradients in place: contiguous copies taken before it are stale.
    for (size_t i = 0; i < params_.size(); ++i)
      if (grads[i].defined() && !params_[i].second.grad().is_contiguous())
        grads[i] = params_[i].second.grad().detach().contiguous();
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (grads[i].defined()) update_one(i, grads[i]);
  ++step_count_;
  return norm;
}

double Optimizer::run_step_multi_tensor(const std::vector<Tensor>& grads, const Clip& clip) {
  // The parameters with a gradient, by device (devices in order of first appearance).
  std::vector<Device> devices;
  std::vector<std::vector<size_t>> on;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grads[i].defined()) continue;
    const Device d = params_[i].second.device();
    size_t k = 0;
    while (k < devices.size() && !(devices[k] == d)) ++k;
    if (k == devices.size()) {
      devices.push_back(d);
      on.emplace_back();
    }
    on[k].push_back(i);
  }
  if (clip.given && !std::isfinite(clip.norm)) return clip.norm;
  if (devices.empty()) {  // no gradients: as clip_grad_norm_ (norm 0) and step()
    ++step_count_;
    return clip.given ? clip.norm : 0.0;
  }

  std::vector<Tensor> work(params_.size());
  for (const auto& list : on)
    for (size_t i : list) {
      ensure_buffers(i);
      const Tensor& p = params_[i].second;
      work[i] = p.is_contiguous() ? p.detach() : p.detach().contiguous();
    }

  // The clip tensors ({norm, scale} per device; undefined without a clip).
  std::vector<Tensor> clips(devices.size());
  double norm = 0.0;
  // Computed on the device when there is one, else on the host (clip_grad_norm_'s sum).
  const bool on_device = clip.on && !clip.given && devices.size() == 1;
  if (on_device) {
    const Device d = devices[0];
    std::vector<kernels::NormSlot> slots;
    int64_t total = 0;
    for (size_t i : on[0]) {
      slots.push_back({grads[i].data_ptr(), grads[i].numel(), grads[i].dtype() == DType::bf16});
      total += kernels::norm_partials_count(grads[i].numel());
    }
    Tensor partials = Tensor::empty({total}, DType::f64, d);
    if (total > 0) KILN_DEVICE_CALL(d, grad_norm_partials_multi, d, slots, clip.norm_type, partials);
    clips[0] = Tensor::empty({2}, DType::f64, d);
    KILN_DEVICE_CALL(d, clip_from_partials, partials, clip.norm_type, clip.max_norm, clips[0]);
  } else if (clip.on) {
    // A given norm, or parameters on several devices: the norm on the host, its clip copied to
    // each device.
    if (clip.given) {
      norm = clip.norm;
    } else {
      std::vector<Tensor> with_grad;
      for (const auto& list : on)
        for (size_t i : list) with_grad.push_back(params_[i].second);
      norm = grad_norm(with_grad, clip.norm_type);
    }
    if (!std::isfinite(norm)) return norm;
    const double scale = kernels::clip_scale(norm, clip.max_norm);
    for (size_t k = 0; k < devices.size(); ++k) clips[k] = from_vector<double>({norm, scale}, {2}, devices[k]);
  }

  for (size_t k = 0; k < devices.size(); ++k) {
    std::vector<MultiItem> items;
    items.reserve(on[k].size());
    for (size_t i : on[k])
      items.push_back({work[i], grads[i], &state_[i].buffers, decay_[i] ? weight_decay_ : 0.0, state_[i].step + 1});
    update_multi(devices[k], items, clips[k]);
  }
  // Read after the update was issued: the only synchronisation (a skipped step's kernels did nothing).
  if (on_device) norm = clips[0].to_vector<double>()[0];
  if (!std::isfinite(norm)) return norm;

  for (const auto& list : on)
    for (size_t i : list) {
      ++state_[i].step;
      const Tensor& p = params_[i].second;
      if (p.is_contiguous()) p.bump_version();
      else p.detach().copy_(work[i]);
    }
  ++step_count_;
  return norm;
}

}  // namespace kiln::optim
