// clip_grad_norm_, grad_norm and sum_of_norm_partials: per-chunk partial norms on each
// gradient's device (one multi-tensor call per device when every gradient there is contiguous
// f32 or bf16, else grad_norm_partials per gradient), one transfer per device, a host sum in
// parameter order, then scaling.
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

// One device's gradients (all contiguous f32 / bf16: one multi-tensor call; else one call per
// gradient) into `partials`, each gradient's chunks after the previous gradient's.
void device_partials(Device d, const std::vector<Tensor>& grads, double norm_type, const Tensor& partials) {
  bool multi = true;
  std::vector<kernels::NormSlot> slots;
  for (const Tensor& g : grads) {
    multi = multi && g.is_contiguous() && (g.dtype() == DType::f32 || g.dtype() == DType::bf16);
    slots.push_back({g.data_ptr(), g.numel(), g.dtype() == DType::bf16});
  }
  if (multi) {
    KILN_DEVICE_CALL(d, grad_norm_partials_multi, d, slots, norm_type, partials);
    return;
  }
  int64_t first = 0;
  for (const Tensor& g0 : grads) {
    const int64_t count = kernels::norm_partials_count(g0.numel());
    if (count == 0) continue;
    Tensor g = g0.is_contiguous() ? g0.detach() : g0.detach().contiguous();
    KILN_DEVICE_CALL(d, grad_norm_partials, g, norm_type, partials.narrow(0, first, count));
    first += count;
  }
}

// sum_of_norm_partials once norm_type is checked.
double partials_sum(const std::vector<Tensor>& grads, double norm_type) {
  NoGradGuard no_grad;
  // Per device, one f64 buffer of partials; each gradient fills its own slice.
  std::vector<Device> devices;
  std::vector<size_t> device_of(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    size_t k = 0;
    while (k < devices.size() && !(devices[k] == grads[i].device())) ++k;
    if (k == devices.size()) devices.push_back(grads[i].device());
    device_of[i] = k;
  }
  std::vector<int64_t> first(grads.size());  // a gradient's first partial in its device's buffer
  std::vector<std::vector<double>> host(devices.size());
  for (size_t k = 0; k < devices.size(); ++k) {
    std::vector<Tensor> mine;
    int64_t count = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (device_of[i] != k) continue;
      first[i] = count;
      mine.push_back(grads[i]);
      count += kernels::norm_partials_count(grads[i].numel());
    }
    if (count == 0) continue;
    Tensor partials = Tensor::empty({count}, DType::f64, devices[k]);
    device_partials(devices[k], mine, norm_type, partials);
    host[k] = partials.to_vector<double>();
  }
  const bool inf_norm = std::isinf(norm_type);
  double acc = 0;
  for (size_t i = 0; i < grads.size(); ++i) {  // parameter order, then chunk order
    const int64_t count = kernels::norm_partials_count(grads[i].numel());
    for (int64_t c = 0; c < count; ++c) {
      const double v = host[device_of[i]][static_cast<size_t>(first[i] + c)];
      if (inf_norm) acc = (v != v || v > acc) ? v : acc;
      else acc += v;
    }
  }
  return acc;
}

double total_norm(const std::vector<Tensor>& grads, double norm_type, const char* op) {
  check_norm_type(norm_type, op);
  return kernels::norm_from_sum(partials_sum(grads, norm_type), kernels::norm_mode(norm_type), norm_type);
}

}  // namespace

double sum_of_norm_partials(const std::vector<Tensor>& grads, double norm_type) {
  check_norm_type(norm_type, "sum_of_norm_partials");
  return partials_sum(grads, norm_type);
}

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
