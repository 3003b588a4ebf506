// Where a training step's time goes, by phase, for `kiln train --profile` (docs/training.md):
// forward, backward and optimizer from the op-level profiler's kernel times (the trainer labels
// its forward "forward:", its optimizer "optimizer:", the autograd engine its backward
// "backward:"), data and comm from the host's wall clock around drawing the batches and
// around waiting on collectives, other = the step's wall time less all of those (host work
// between kernels, launch gaps; on CUDA also kernels' overlap with the host).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/core/profile.h"
#include "kiln/io/json.h"

namespace kiln::train {

// The phase of a profiler key ("forward:step/gemm" -> "forward", "backward:matmul/gemm" ->
// "backward"); "" for keys outside a step's phases (unlabelled, eval:, ...).
std::string phase_of(const std::string& key);

struct PhaseTimes {
  double forward_ms = 0, backward_ms = 0, optimizer_ms = 0, data_ms = 0, comm_ms = 0, step_ms = 0;
  int64_t steps = 0;
  double other_ms() const;
  PhaseTimes minus(const PhaseTimes& earlier) const;
  // Per step: {"forward_ms": ..., ..., "other_ms", "step_ms"} (means over `steps`).
  json::Value to_json() const;
};

class StepProfile {
 public:
  // Off (every call a no-op) when `prof` is null.
  explicit StepProfile(profile::Profiler* prof) : prof_(prof) {}
  bool on() const { return prof_ != nullptr; }
  // Host wall time of the enclosing region, added to data or comm.
  class Wall {
   public:
    Wall(StepProfile& p, double PhaseTimes::*field) : p_(p), field_(field), t0_(std::chrono::steady_clock::now()) {}
    ~Wall() {
      if (p_.on()) p_.host_.*field_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
    }
    Wall(const Wall&) = delete;
    Wall& operator=(const Wall&) = delete;

   private:
    StepProfile& p_;
    double PhaseTimes::*field_;
    std::chrono::steady_clock::time_point t0_;
  };
  void add_step(double wall_ms);
  // Host time spent waiting on collectives (FSDP's all-gathers and reduce-scatters).
  void add_comm(double ms) {
    if (on()) host_.comm_ms += ms;
  }
  // Everything since the profiler's last reset (harvests CUDA timings: waits for them).
  PhaseTimes totals() const;
  // Forgets the host times and steps too (the profiler was reset after a warm-up step).
  void reset();

 private:
  profile::Profiler* prof_;
  PhaseTimes host_;  // data_ms, comm_ms, step_ms, steps
};

}  // namespace kiln::train
