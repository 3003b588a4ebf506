// clip_grad_norm_ and grad_norm: per-chunk partial norms on each gradient's device (kernel
// grad_norm_partials), one transfer per device, a host sum in parameter order, then scaling.
#include "kiln/optim/clip.h"

#include <cmath>
#include <map>

#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/optim.h"
#include "kiln/ops/ops.h"

namespace kiln::optim {
namespace {

std::vector<Tensor> grads_of(const std::vector<Tensor>& params, const char* op) {
  std::vector<Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    KILN_CHECK(params[i].defined(), op, ": parameter ", i, " is an undefined tensor");
    Tensor g = params[i].grad();
    if (!g.defined()) continue;
    KILN_CHECK(is_floating(g.dtype()), op, ": gradient of parameter ", i, " has dtype ", dtype_name(g.dtype()));
    grads.push_back(g);
  }
  return grads;
}

void check_norm_type(double norm_type, const char* op) {
  KILN_CHECK(norm_type > 0.0 && !std::isnan(norm_type), op, ": norm_type=", norm_type, " must be > 0 (or inf)");
}

double total_norm(const std::vector<Tensor>& grads, double norm_type, const char* op) {
  check_norm_type(norm_type, op);
  NoGradGuard no_grad;
  // Per device, one f64 buffer of partials; each gradient fills its own slice.
  std::vector<std::pair<Device, int64_t>> slot(grads.size());  // device, first partial
  std::vector<std::pair<Device, int64_t>> devices;             // device, partials count
  for (size_t i = 0; i < grads.size(); ++i) {
    Device d = grads[i].device();
    size_t k = 0;
    while (k < devices.size() && !(devices[k].first == d)) ++k;
    if (k == devices.size()) devices.emplace_back(d, 0);
    slot[i] = {d, devices[k].second};
    devices[k].second += kernels::norm_partials_count(grads[i].numel());
  }
  std::vector<std::vector<double>> host(devices.size());
  for (size_t k = 0; k < devices.size(); ++k) {
    const Device d = devices[k].first;
    Tensor partials = Tensor::empty({devices[k].second}, DType::f64, d);
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!(slot[i].first == d)) continue;
      const int64_t count = kernels::norm_partials_count(grads[i].numel());
      if (count == 0) continue;
      Tensor g = grads[i].is_contiguous() ? grads[i].detach() : grads[i].detach().contiguous();
      KILN_DEVICE_CALL(d, grad_norm_partials, g, norm_type, partials.narrow(0, slot[i].second, count));
    }
    host[k] = partials.to_vector<double>();
  }
  const bool inf_norm = std::isinf(norm_type);
  double acc = 0;
  for (size_t i = 0; i < grads.size(); ++i) {  // parameter order, then chunk order
    size_t k = 0;
    while (!(devices[k].first == slot[i].first)) ++k;
    const int64_t count = kernels::norm_partials_count(grads[i].numel());
    for (int64_t c = 0; c < count; ++c) {
      const double v = host[k][static_cast<size_t>(slot[i].second + c)];
      if (inf_norm) acc = (v != v || v > acc) ? v : acc;
      else acc += v;
    }
  }
  return kernels::norm_from_sum(acc, kernels::norm_mode(norm_type), norm_type);
}

}  // namespace

double grad_norm(const std::vector<Tensor>& params, double norm_type) {
  return total_norm(grads_of(params, "grad_norm"), norm_type, "grad_norm");
}

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, const ClipGradOptions& options) {
  const char* op = "clip_grad_norm_";
  // inf never clips (as torch: the call then only measures the norm).
  KILN_CHECK(!std::isnan(max_norm) && max_norm >= 0.0, op, ": max_norm=", max_norm, " must be >= 0 (or inf)");
  check_norm_type(options.norm_type, op);  // also when no parameter has a gradient
  std::vector<Tensor> grads = grads_of(params, op);
  if (grads.empty()) return 0.0;
  const double norm = total_norm(grads, options.norm_type, op);
  if (!std::isfinite(norm)) {
    KILN_CHECK(!options.error_if_nonfinite, op, ": the total norm of order ", options.norm_type,
               " of the gradients is ", norm, " (non-finite); gradients left unchanged");
    return norm;
  }
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    NoGradGuard no_grad;
    // In the gradient's precision, as torch (f64 gradients in f64: rounded to f32, a coefficient
    // of 2e-51 was 0).
    for (Tensor& g : grads) mul_(g, g.dtype() == DType::f64 ? coef : static_cast<double>(static_cast<float>(coef)));
  }
  return norm;
}

double clip_grad_norm_(const NamedTensors& params, double max_norm, const ClipGradOptions& options) {
  std::vector<Tensor> ps;
  ps.reserve(params.size());
  for (const auto& [name, p] : params) ps.push_back(p);
  return clip_grad_norm_(ps, max_norm, options);
}

}  // namespace kiln::optim
