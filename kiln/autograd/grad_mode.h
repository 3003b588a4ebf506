// Grad mode: whether ops record autograd history on this thread. NoGradGuard turns it off
// for a scope (as torch.no_grad()).
#pragma once

namespace kiln {

bool grad_enabled();
void set_grad_enabled(bool on);

class NoGradGuard {
 public:
  NoGradGuard() : previous_(grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Determinism: when on, every kernel is bitwise reproducible run to run (fixed reduction
// orders, fixed thread partitions, no float atomics). Process-wide, off by default.
bool deterministic();
void set_deterministic(bool on);

}  // namespace kiln
