// Generated sources of FlexAttention kernels for run-time mods (docs/jit.md): a score_mod and a
// mask_mod given as C++ expressions become functors (namespace kiln::jit::expr::gen, over the
// helpers of kiln/jit/expr_prelude.h) instantiated into kiln's own kernel templates, with
// extern "C" entry points the front end (attention/runtime_mods.cpp) calls.
//
// Names an expression sees: score (score_mod only), b, h, q_idx, kv_idx (int), q_len, kv_len
// (int64: L and S), its captures, inf, true / false, the casts float(x), double(x), int(x),
// int64_t(x), bool(x), and the functions of expr_prelude.h. Each
// capture is a float (f32) or int (i32) view of rank 1..4, indexed with []. Anything else is an
// error naming it before any compiler runs; so is a ';', '{', '}', '#', quote or backslash (an
// expression is one expression).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::jit {

struct CaptureSig {
  std::string name;
  bool is_int = false;     // i32 (else f32)
  int rank = 1;            // 1..4
  bool learnable = false;  // receives a gradient (score_mod, f32, at most one)
};

struct ModSpec {
  std::string kind;    // "score_mod" or "mask_mod": the #line name of its expression
  std::string expr;    // the expression ("score" / "true" for none)
  std::string dscore;  // score_mod: its derivative w.r.t. score, or "" (forward-mode, automatic)
  std::vector<CaptureSig> captures;
};

// Fails, naming the mod, the expression and the name or character, unless `m` is well formed
// as above (the compiler checks the rest).
void check_mod(const ModSpec& m);

// The whole CPU translation unit of one kernel: "forward" or "backward" for the storage type
// `storage` ("f32", "bf16", "f16"); exports kiln_flex_forward / kiln_flex_backward.
std::string flex_cpu_source(const ModSpec& score, const ModSpec& mask, const std::string& storage, bool backward);
// The CPU tile classifier of a mask_mod (create_block_mask); exports kiln_flex_classify.
std::string classify_cpu_source(const ModSpec& mask);
// The CUDA tile classifier of a mask_mod (NVRTC, device-only headers): extern "C" __global__
// kiln_flex_classify(CaptureArgs caps, Bm, Hm, L, S, qb, kb, uint8_t* out), one thread per tile.
std::string classify_cuda_source(const ModSpec& mask);
// The CUDA kernels of one pair (NVRTC, device-only headers: kernels/cuda/attention_simt.cuh's
// bodies, f32 math on the storage type `storage` ("f32", "bf16" as cuda_bf16.h's __nv_bfloat16,
// "f16" as cuda_fp16.h's __half: the same 16 bits and round-to-nearest-even conversions as kiln's
// BFloat16 / Half), row vectors of `maxd` floats): the forward exports extern "C"
// kiln_flex_fwd; the backward kiln_flex_delta, kiln_flex_dq, kiln_flex_dkdv, and with a
// learnable score_mod capture kiln_flex_dcap_partial (one thread per (b, h, q block): its partial
// row of FlexParams::bias_row floats) and kiln_flex_dcap_reduce(FlexParams) (one thread per
// element, the rows summed in task order into dbias); each takes (FlexParams, ScoreMod, MaskMod)
// by value, the functors laid out as functor_bytes() says.
std::string flex_cuda_source(const ModSpec& score, const ModSpec& mask, int maxd, bool backward,
                             const std::string& storage = "f32");
// The kernels flex_cuda_source exports, in launch order: the forward's, or the backward's (with
// the captured gradient's two when `learnable`).
std::vector<std::string> flex_cuda_kernels(bool backward, bool learnable);
// The Hopper kernels of one pair (NVRTC, device-only headers: kernels/cuda/attention_fwd_wgmma.cuh
// and attention_bwd_wgmma.cuh, the very templates of the built-in mods, instantiated with the
// generated functors) on "bf16" or "f16" storage. The source instantiates nothing itself:
// flex_hopper_kernels gives the name expressions (CompileRequest::name_expressions) of the
// kernels a call needs: the forward's, or the backward's dQ and dK/dV passes, at head dim 64 or
// 128. Their arguments are kernels/flex_hopper.h's, the functors laid out as functor_bytes()
// says. A learnable capture has no Hopper backward (the SIMT one computes its gradient).
std::string flex_hopper_source(const ModSpec& score, const ModSpec& mask, const std::string& storage);
std::vector<std::string> flex_hopper_kernels(int head_dim, bool backward, const std::string& storage);
// A generated functor's bytes as a kernel argument: int64 q_len, kv_len, then per capture its
// data pointer, sizes[4], strides[4] (int64) and flag pointer. The identity score_mod is
// NoScoreMod: one byte.
std::vector<unsigned char> functor_bytes(bool identity, int64_t q_len, int64_t kv_len, const void* const* data,
                                         const int64_t (*sizes)[4], const int64_t (*strides)[4],
                                         int32_t* const* flags, size_t n);
bool is_identity(const ModSpec& score);
// The most captures a CUDA kernel takes (CaptureArgs holds them by value).
inline constexpr int kMaxCudaCaptures = 8;
// The functors alone (for the CUDA sources too).
std::string mod_functors(const ModSpec& score, const ModSpec& mask);

}  // namespace kiln::jit
