// kernels/flex_hopper.h on CUDA: the plans of attention_launch.cuh, their tensor maps copied out
// as bytes for a launch through the driver.
#include <cstring>

#include "kiln/kernels/cuda/attention_launch.cuh"
#include "kiln/kernels/flex_hopper.h"

namespace kiln::kernels {
namespace {
namespace fw = cuda::flex_wgmma;
static_assert(sizeof(CUtensorMap) == 128 && sizeof(fw::BwdMaps) == 6 * 128, "tensor maps are 128 bytes");

FlexHopperLaunch launch_of(const fw::HopperLaunch& l) {
  return FlexHopperLaunch{l.grid, static_cast<unsigned>(fw::kThreads), static_cast<unsigned>(l.smem), l.heads_fastest,
                          l.tile_counter};
}

template <class CT> bool plan(const FlexParams& p, bool backward, cudaStream_t st, FlexHopperPlan& out) {
  if (!backward) {
    fw::FwdPlan f;
    if (!fw::plan_forward<CT>(p, f, st)) return false;
    const CUtensorMap* maps[] = {&f.tq, &f.tk, &f.tv, &f.to};
    for (int i = 0; i < 4; ++i) std::memcpy(out.maps[i], maps[i], 128);
    out.head_dim = f.head_dim;
    out.fwd = launch_of(f.launch);
    return true;
  }
  fw::BwdPlan b;
  if (!fw::plan_backward<CT>(p, b, st)) return false;
  std::memcpy(out.maps[0], &b.q_side, sizeof b.q_side);
  std::memcpy(out.maps[6], &b.kv_side, sizeof b.kv_side);
  out.head_dim = b.head_dim;
  out.dq = launch_of(b.dq);
  out.dkdv = launch_of(b.dkdv);
  return true;
}
}  // namespace

bool plan_flex_hopper(const FlexParams& p, bool bf16, bool backward, const Stream& stream, FlexHopperPlan& out) {
  const cudaStream_t st = static_cast<cudaStream_t>(stream.native());
  out = FlexHopperPlan{};
  return bf16 ? plan<__nv_bfloat16>(p, backward, st, out) : plan<__half>(p, backward, st, out);
}

}  // namespace kiln::kernels
