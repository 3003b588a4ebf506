// Run-time FlexAttention mods (docs/jit.md): a score_mod or mask_mod given as a C++ expression
// over score, b, h, q_idx, kv_idx (mask: without score), q_len, kv_len and named captured
// tensors, compiled by the JIT (kiln/jit/) on first use and cached on disk. Captures are kernel
// arguments, so new values never recompile (a capture's name, dtype and rank are part of the
// kernel; its shape and values are not). A captured f32 tensor that requires grad gets a
// deterministic gradient (summed per (b, h, q block) task, then over the tasks in order).
//
//   RuntimeScoreMod alibi{"score + slopes[h] * (kv_idx - q_idx)", {{"slopes", slopes}}};
//   auto mask = create_block_mask(RuntimeMaskMod{"q_idx >= kv_idx && q_idx - kv_idx < 1024"}, 1, 1, L, S);
//   auto r = flex_attention(q, k, v, alibi, mask);
//
// The CPU kernels are kiln's own kernel templates instantiated with the expression (the same
// bits as the library mod it spells: tests/jit). On CUDA, with the hopper backend, NVRTC
// instantiates the built-in Hopper kernels with the expression (bf16 / f16, head dim 64 or 128,
// blocks multiples of 128; kernels/flex_hopper.h); otherwise the SIMT kernels run (f32 / bf16 /
// f16, a learnable capture's gradient included; docs/jit.md says what is missing), on the
// thread's current stream.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "kiln/attention/flex_attention.h"
#include "kiln/jit/compile_service.h"

namespace kiln::attention {

using Captures = std::vector<std::pair<std::string, Tensor>>;

struct RuntimeScoreMod {
  RuntimeScoreMod(std::string e = "score", Captures c = {}, std::string d = "")
      : expr(std::move(e)), captures(std::move(c)), dscore(std::move(d)) {}
  std::string expr;            // the new score
  Captures captures;           // f32 or integer (ids, stored i32) tensors of 1..4 dims
  // Optional: d expr / d score as an expression (else forward-mode derivatives compute it; give
  // it to match a hand-written dscore bit for bit).
  std::string dscore;
};

struct RuntimeMaskMod {
  RuntimeMaskMod(std::string e = "true", Captures c = {}) : expr(std::move(e)), captures(std::move(c)) {}
  std::string expr;           // true keeps the pair
  Captures captures;
};

struct RuntimeBlockMask {
  RuntimeMaskMod mask_mod;
  BlockLayout layout;
};

// The BlockMask of a run-time mask_mod: its tiles classified by a compiled classifier.
RuntimeBlockMask create_block_mask(const RuntimeMaskMod& mask_mod, int64_t batch, int64_t heads, int64_t q_len,
                                   int64_t kv_len, int64_t q_block = kDefaultBlockSize,
                                   int64_t kv_block = kDefaultBlockSize, Device device = kCPU);

FlexResult flex_attention(const Tensor& q, const Tensor& k, const Tensor& v, const RuntimeScoreMod& score_mod,
                          const RuntimeBlockMask& block_mask, const FlexOptions& options = {});

// The tensors of `file` (name, tensor pairs: a safetensors file's, io/safetensors.h) that `expr` names as
// identifiers, as captures (a file may hold the captures of several expressions).
Captures captures_named_in(const std::string& expr, const Captures& file);

// Starts compiling, in the JIT's pool, the kernels such a call needs (the forward, and the
// backward when `backward`; the classifier of the mask), without waiting: the trainer and
// `kiln precompile` call it for every kernel of a run (runtime_mods_setup.h), then wait on the
// tickets. On CUDA the cubins go to the disk cache, for the SIMT row size of `head_dim` (0: both)
// (and the Hopper kernels of 16-bit storage once the automatic backend picks them, docs/jit.md).
std::vector<jit::Ticket> precompile_flex(const RuntimeScoreMod& score_mod, const RuntimeMaskMod& mask_mod, DType dtype,
                                         Device device, bool backward, int64_t head_dim = 0);

}  // namespace kiln::attention
