// Grad mode: whether ops record autograd history on this thread. NoGradGuard turns it off
// for a scope (as torch.no_grad()). The determinism switch (deterministic, set_deterministic)
// is a runtime switch of kiln/core/switches.h, included here for the callers that found it here.
#pragma once

#include "kiln/core/switches.h"

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

}  // namespace kiln
