// Learning-rate schedules (formulas in schedule.h).
#include "kiln/optim/schedule.h"

#include <cmath>
#include <numbers>

#include "kiln/core/error.h"

namespace kiln::optim {

ScheduleKind parse_schedule_kind(std::string_view s) {
  if (s == "constant") return ScheduleKind::constant;
  if (s == "cosine") return ScheduleKind::cosine;
  if (s == "linear") return ScheduleKind::linear;
  fail("lr schedule: unknown kind '", s, "' (expected constant, cosine or linear)");
}

const char* schedule_kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::constant: return "constant";
    case ScheduleKind::cosine: return "cosine";
    case ScheduleKind::linear: return "linear";
  }
  return "?";
}

double warmup_lr(double max_lr, int64_t step, int64_t warmup_steps) {
  KILN_CHECK(step >= 0, "lr schedule: step=", step, " must be >= 0");
  if (step >= warmup_steps) return max_lr;
  return max_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
}

double cosine_decay_lr(double max_lr, double min_lr, int64_t step, int64_t decay_start, int64_t decay_end) {
  KILN_CHECK(decay_end > decay_start, "lr schedule: decay end ", decay_end, " must be > decay start ", decay_start);
  if (step <= decay_start) return max_lr;
  if (step >= decay_end) return min_lr;
  const double ratio = static_cast<double>(step - decay_start) / static_cast<double>(decay_end - decay_start);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
  return min_lr + coeff * (max_lr - min_lr);
}

void LrSchedule::validate() const {
  KILN_CHECK(kind == ScheduleKind::constant || kind == ScheduleKind::cosine || kind == ScheduleKind::linear,
             "lr schedule: kind=", static_cast<int>(kind), " is not one of: constant, cosine, linear");
  const char* name = schedule_kind_name(kind);
  KILN_CHECK(std::isfinite(max_lr) && max_lr >= 0.0, "lr schedule (", name, "): max_lr=", max_lr,
             " must be finite and >= 0");
  KILN_CHECK(warmup_steps >= 0, "lr schedule (", name, "): warmup_steps=", warmup_steps, " must be >= 0");
  if (kind == ScheduleKind::constant) return;
  KILN_CHECK(std::isfinite(min_lr) && min_lr >= 0.0 && min_lr <= max_lr, "lr schedule (", name, "): min_lr=", min_lr,
             " must be in [0, max_lr=", max_lr, "]");
  KILN_CHECK(total_steps > warmup_steps, "lr schedule (", name, "): total_steps=", total_steps,
             " must be > warmup_steps=", warmup_steps);
}

double LrSchedule::lr_at(int64_t step) const {
  validate();
  KILN_CHECK(step >= 0, "lr schedule: step=", step, " must be >= 0");
  if (step < warmup_steps) return warmup_lr(max_lr, step, warmup_steps);
  switch (kind) {
    case ScheduleKind::constant: return max_lr;
    case ScheduleKind::cosine: return cosine_decay_lr(max_lr, min_lr, step, warmup_steps, total_steps);
    case ScheduleKind::linear: {
      if (step >= total_steps) return min_lr;
      const double ratio =
          static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
      return max_lr + ratio * (min_lr - max_lr);
    }
  }
  return max_lr;
}

}  // namespace kiln::optim
