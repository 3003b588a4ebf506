// Learning-rate schedules: pure functions of the step (0-based, the number of optimizer steps
// taken before this one), so a resumed run recomputes the same lr from its step count.
//   constant: max_lr after a linear warmup
//   cosine:   linear warmup, then cosine decay from max_lr to min_lr at total_steps (llm.c)
//   linear:   linear warmup, then linear decay from max_lr to min_lr at total_steps
// Warmup (llm.c): lr = max_lr * (step + 1) / warmup_steps for step < warmup_steps.
// Decay: ratio = (step - warmup_steps) / (total_steps - warmup_steps) in [0, 1];
// cosine: min_lr + 0.5 * (1 + cos(pi * ratio)) * (max_lr - min_lr). After total_steps: min_lr.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::optim {

enum class ScheduleKind { constant, cosine, linear };
// "constant", "cosine", "linear"; kiln::Error naming the accepted values otherwise.
ScheduleKind parse_schedule_kind(std::string_view s);
const char* schedule_kind_name(ScheduleKind k);

struct LrSchedule {
  ScheduleKind kind = ScheduleKind::cosine;
  double max_lr = 3e-4;
  double min_lr = 0.0;          // cosine/linear: the lr at and after total_steps
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;      // cosine/linear: must be > warmup_steps

  // Throws kiln::Error naming the field when the schedule is inconsistent (negative or
  // non-finite rates, min_lr > max_lr, total_steps <= warmup_steps for a decaying kind).
  void validate() const;
  // The lr of `step` (>= 0); validates first.
  double lr_at(int64_t step) const;
};

// The pieces, for callers that want them alone.
double warmup_lr(double max_lr, int64_t step, int64_t warmup_steps);
double cosine_decay_lr(double max_lr, double min_lr, int64_t step, int64_t decay_start, int64_t decay_end);

}  // namespace kiln::optim
