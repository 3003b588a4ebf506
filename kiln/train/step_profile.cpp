// Phase times of training steps (see step_profile.h).
#include "kiln/train/step_profile.h"

#include <algorithm>

namespace kiln::train {

std::string phase_of(const std::string& key) {
  const size_t colon = key.find(':'), slash = key.find('/');
  if (colon == std::string::npos || (slash != std::string::npos && slash < colon)) return "";
  const std::string p = key.substr(0, colon);
  return p == "forward" || p == "backward" || p == "optimizer" ? p : "";
}

double PhaseTimes::other_ms() const {
  return std::max(0.0, step_ms - forward_ms - backward_ms - optimizer_ms - data_ms - comm_ms);
}

PhaseTimes PhaseTimes::minus(const PhaseTimes& e) const {
  PhaseTimes d;
  d.forward_ms = forward_ms - e.forward_ms;
  d.backward_ms = backward_ms - e.backward_ms;
  d.optimizer_ms = optimizer_ms - e.optimizer_ms;
  d.data_ms = data_ms - e.data_ms;
  d.comm_ms = comm_ms - e.comm_ms;
  d.step_ms = step_ms - e.step_ms;
  d.steps = steps - e.steps;
  return d;
}

json::Value PhaseTimes::to_json() const {
  const double n = steps > 0 ? static_cast<double>(steps) : 1.0;
  json::Value v = json::Value::object();
  v["forward_ms"] = forward_ms / n;
  v["backward_ms"] = backward_ms / n;
  v["optimizer_ms"] = optimizer_ms / n;
  v["data_ms"] = data_ms / n;
  v["comm_ms"] = comm_ms / n;
  v["other_ms"] = other_ms() / n;
  v["step_ms"] = step_ms / n;
  v["steps"] = steps;
  return v;
}

void StepProfile::add_step(double wall_ms) {
  if (!on()) return;
  host_.step_ms += wall_ms;
  ++host_.steps;
}

PhaseTimes StepProfile::totals() const {
  PhaseTimes t = host_;
  if (!on()) return t;
  for (const profile::Entry& e : prof_->entries()) {
    const std::string p = phase_of(e.name);
    if (p == "forward") t.forward_ms += e.total_ms;
    else if (p == "backward") t.backward_ms += e.total_ms;
    else if (p == "optimizer") t.optimizer_ms += e.total_ms;
  }
  return t;
}

void StepProfile::reset() { host_ = PhaseTimes{}; }

}  // namespace kiln::train
