// The Hopper FlexAttention kernels (TMA + wgmma, kernels/cuda/attention_fwd_wgmma.cuh and
// attention_bwd_wgmma.cuh) for a caller that brings the kernels itself: the JIT, which
// instantiates them with run-time mods through NVRTC (attention/runtime_mods_cuda.cpp) and
// launches them through the driver with what plan_flex_hopper gives. The built-in mods' kernels
// are planned and launched the same way inside kernels/cuda/attention_launch.cuh.
//
// A forward kernel's arguments: the tensor maps maps[0..3] (each by value), FlexParams, the
// score_mod, the mask_mod, bool heads_fastest, int32_t* tile_counter. A backward pass's: its
// BwdMaps (six maps: maps[0..5] for dQ, maps[6..11] for dK/dV, by value), then the same.
// Defined in kernels/cuda/hopper_plan.cu; without CUDA (kernels/cuda/hopper_plan_stub.cpp) it
// applies to nothing.
#pragma once
#include <cstdint>

#include "kiln/core/stream.h"
#include "kiln/kernels/flex_params.h"

namespace kiln::kernels {

struct FlexHopperLaunch {
  unsigned grid = 0;     // CTAs of the persistent grid; 0: nothing to launch
  unsigned threads = 0;  // per CTA
  unsigned smem = 0;     // dynamic shared memory, bytes
  bool heads_fastest = false;
  int32_t* tile_counter = nullptr;  // zeroed on the stream by the plan
};

struct FlexHopperPlan {
  int head_dim = 0;  // the kernels' D (E = Ev): 64 or 128
  alignas(64) unsigned char maps[12][128];  // CUtensorMaps
  FlexHopperLaunch fwd, dq, dkdv;           // the forward's, or the backward's passes in order
};

// Whether the Hopper kernels run this call on the current device (16-bit storage: bf16, else
// f16; the layout, alignment and block sizes as the built-in kernels need them), with the plan;
// false: they do not apply, and nothing was done. A learnable score_mod is the caller's to keep
// away from the backward. The tile counters are zeroed on `stream`.
bool plan_flex_hopper(const FlexParams& p, bool bf16, bool backward, const Stream& stream, FlexHopperPlan& plan);

}  // namespace kiln::kernels
