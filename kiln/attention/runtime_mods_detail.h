// Internal to kiln/attention: what runtime_mods.cpp (the front end, the CPU kernels) and
// runtime_mods_cuda.cpp (the CUDA kernels) share: captures bound and checked, the flex kernels'
// names and registry digests, and the CUDA half's entry points.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/attention/runtime_mods.h"
#include "kiln/jit/compile_service.h"
#include "kiln/jit/expr_prelude.h"
#include "kiln/jit/flex_source.h"
#include "kiln/kernels/flex_params.h"

namespace kiln::attention::runtime_detail {

using jit::expr::CaptureArg;

// A mod's captures, checked and laid out for the kernels (contiguous, ids as i32).
struct BoundCaptures {
  std::vector<Tensor> tensors;
  std::vector<jit::CaptureSig> sigs;
};
BoundCaptures bind_captures(const char* kind, const Captures& caps, Device device, bool allow_grad);
// The kernels' view of `tensors`; flags[i] is set by a kernel that read capture i out of range.
std::vector<CaptureArg> capture_args(const std::vector<Tensor>& tensors, std::vector<int32_t>& flags);
// An error naming the first capture whose flag is set.
void check_flags(const std::vector<int32_t>& flags, const std::vector<std::pair<std::string, Tensor>>& named);

// What a flex kernel's generated source is made from besides its family, storage and options:
// the digest the in-process registry keys on (no source generated on a call that finds it).
std::string pair_digest(const jit::ModSpec& s, const jit::ModSpec& m);
const char* flex_family(bool backward);  // "flex_forward" or "flex_backward"
// The name a compilation shows while it runs: "flex_forward hopper bf16 (score | q_idx >= kv_idx)".
std::string flex_name(bool backward, const std::string& kind, const std::string& storage, const jit::ModSpec& s,
                      const jit::ModSpec& m);
std::vector<std::string> flex_user_files();  // the #line names of the user's expressions

// runtime_mods_cuda.cpp. The tile classes of a run-time mask classified on `device`.
std::vector<uint8_t> classify_on_gpu(const jit::ModSpec& spec, const std::vector<Tensor>& caps, const Captures& named,
                                     int64_t Bm, int64_t Hm, int64_t L, int64_t S, int64_t qb, int64_t kb,
                                     Device device);
// The forward or the backward of a run-time pair on CUDA (storage `dt`), on the thread's current
// stream of `device`: the Hopper kernels where they apply and are asked for, else the SIMT ones.
void run_cuda_flex(bool backward, const kernels::FlexParams& p, const jit::ModSpec& s, const jit::ModSpec& m,
                   const std::vector<Tensor>& caps, size_t n_score, const Captures& named, Device device, DType dt);
// An error unless q's dtype has run-time kernels on CUDA.
void check_cuda_call(const Tensor& q);
// The CUDA kernels of a pair submitted to the pool, into the disk cache.
std::vector<jit::Ticket> precompile_cuda(const jit::ModSpec& s, const jit::ModSpec& m, DType dtype, bool backward,
                                         int64_t head_dim);

}  // namespace kiln::attention::runtime_detail
