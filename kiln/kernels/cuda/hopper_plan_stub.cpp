// kernels/flex_hopper.h without CUDA: the Hopper kernels apply to nothing.
#include "kiln/kernels/flex_hopper.h"

namespace kiln::kernels {

bool plan_flex_hopper(const FlexParams&, bool, bool, const Stream&, FlexHopperPlan&) { return false; }

}  // namespace kiln::kernels
