// FlexAttention modifiers, device-only (no host code: NVRTC compiles this header, see
// kernels/device_std.h): the score_mod and mask_mod functors with host+device call operators and
// is_learnable_v. The C++20 concepts that check them and the host helpers are in
// kiln/attention/mods.h, which includes this. The library: noop, causal, sliding window, document,
// prefix LM, ALiBi, softcap, learnable relative-position bias, and_masks / or_masks.
//
// NOTE [flex mods]
// - mask_mod(b, h, q_idx, kv_idx) -> bool: true keeps the pair. b and h are the query's batch
//   and (query) head indices; q_idx/kv_idx are absolute positions (top-left aligned, as PyTorch).
// - score_mod(score, b, h, q_idx, kv_idx) -> score', templated on the value type (float in the
//   kernels, double in the reference). score is already scaled (scale * q·k), as in PyTorch.
//   Every score_mod also gives dscore(score, ...) = d score' / d score, which the backward
//   multiplies in (the C++ counterpart of PyTorch's traced derivative).
// - Both must be pure, and safe at any in-range index (0 <= q_idx < L, 0 <= kv_idx < S): the
//   kernels evaluate them branch-free on whole tiles, masked pairs included (their results are
//   then discarded), as PyTorch applies score_mod before the mask. A mod must not rely on the
//   mask to guard a table read (e.g. bias[q - kv] under a causal mask reads bias[-1]).
// - A score_mod with a learnable tensor (RelativePositionBias) declares kLearnable and
//   bias_index(): the backward accumulates d loss / d score' into grad[bias_index] in a fixed
//   order (deterministic). The front end binds the tensor (options.bias) to the functor.
// Functors hold raw pointers (device pointers for CUDA) to their tables; the caller keeps the
// tables alive while the attention and its backward run.
#pragma once
#ifndef __CUDACC_RTC__
#include <math.h>
#endif

#include "kiln/core/macros.h"
#include "kiln/kernels/device_std.h"

namespace kiln::attention {

// tanh for the score mods. In float on the GPU: 1 − 2 / (1 + e^{2x}) with the special-function
// unit's exponential and reciprocal (5 instructions, absolute error under 1e-6, f32's level for a
// value in [−1, 1]) instead of tanhf (16 instructions with the same two MUFU: a polynomial for
// |x| < 0.6 selected against this form). ±inf and large |x| give ±1, NaN stays NaN. On the host
// tanhf / tanh.
template <class T> KILN_HD T tanh_t(T x) {
  if constexpr (sizeof(T) == 4) {
#ifdef __CUDA_ARCH__
    return 1.0f - __fdividef(2.0f, 1.0f + __expf(2.0f * x));
#else
    return ::tanhf(x);
#endif
  } else {
    return ::tanh(x);
  }
}

// A score_mod with a learnable table declares kLearnable = true and bias_index(b, h, q, kv)
// (LearnableScoreMod in attention/mods.h checks the signature).
template <class S, class = void> inline constexpr bool is_learnable_v = false;
template <class S> inline constexpr bool is_learnable_v<S, decltype(void(S::kLearnable))> = S::kLearnable;
// A score_mod whose captured tensor learns (the JIT's run-time mods, kiln/jit/flex_source.cpp)
// declares kCaptureGrad = true and capture_grad(score, b, h, q, kv, &offset) = d score' / d
// capture[offset] (offset −1: the pair reads none); the CPU backward sums d loss / d score' times
// it per (b, h, q block) task over the whole capture, then over the tasks in order.
template <class S, class = void> inline constexpr bool has_capture_grad_v = false;
template <class S> inline constexpr bool has_capture_grad_v<S, decltype(void(S::kCaptureGrad))> = S::kCaptureGrad;

// ---- mask mods ----
struct NoMask {  // every pair kept
  KILN_HD bool operator()(int, int, int, int) const { return true; }
};
struct Causal {  // q_idx >= kv_idx
  KILN_HD bool operator()(int, int, int q, int kv) const { return q >= kv; }
};
struct SlidingWindow {  // causal, and at most `window` tokens back (the query included)
  int window = 256;
  // 0 <= q − kv < window as one unsigned compare (q − kv cannot overflow: indices are
  // non-negative ints); a window <= 0 keeps nothing.
  KILN_HD bool operator()(int, int, int q, int kv) const {
    return static_cast<unsigned>(q - kv) < static_cast<unsigned>(window > 0 ? window : 0);
  }
};
struct PrefixLM {  // the first `prefix` tokens are seen by everyone; causal after
  int prefix = 0;
  KILN_HD bool operator()(int, int, int q, int kv) const { return (kv < prefix) | (q >= kv); }
};
// Packed documents: keeps pairs in the same document (ids per position, int32, q and kv side;
// the same pointer when L == S). Combine with Causal via and_masks for causal packing.
struct Document {
  const int32_t* q_doc = nullptr;
  const int32_t* kv_doc = nullptr;
  KILN_HD bool operator()(int, int, int q, int kv) const { return q_doc[q] == kv_doc[kv]; }
};

template <class A, class B>  // (attention/mods.h: and_masks, checked by MaskMod)
struct AndMask {
  A a;
  B b;
  KILN_HD bool operator()(int bi, int h, int q, int kv) const { return a(bi, h, q, kv) && b(bi, h, q, kv); }
};
template <class A, class B>  // (attention/mods.h: or_masks)
struct OrMask {
  A a;
  B b;
  KILN_HD bool operator()(int bi, int h, int q, int kv) const { return a(bi, h, q, kv) || b(bi, h, q, kv); }
};
// Causal + same document (the trainer's "document" mask and the bench's document:N).
using DocumentCausal = AndMask<Causal, Document>;

// ---- score mods ----
struct NoScoreMod {
  template <class T> KILN_HD T operator()(T s, int, int, int, int) const { return s; }
  template <class T> KILN_HD T dscore(T, int, int, int, int) const { return T(1); }
};
// ALiBi: score + slope[h] * (kv_idx - q_idx); slopes per query head (f32).
struct Alibi {
  const float* slopes = nullptr;
  template <class T> KILN_HD T operator()(T s, int, int h, int q, int kv) const {
    return s + static_cast<T>(slopes[h]) * static_cast<T>(kv - q);
  }
  template <class T> KILN_HD T dscore(T, int, int, int, int) const { return T(1); }
};
// Soft-capping (Gemma 2): cap * tanh(score / cap). score / cap is taken as score · (1 / cap):
// the reciprocal is the same for every element (the kernels compute it once); a float division
// on the GPU is a refined reciprocal, a range check and a branch to a slow path, per element.
struct Softcap {
  float cap = 50.0f;
  template <class T> KILN_HD T operator()(T s, int, int, int, int) const {
    return static_cast<T>(cap) * tanh_t(s * (T(1) / static_cast<T>(cap)));
  }
  template <class T> KILN_HD T dscore(T s, int, int, int, int) const {
    const T t = tanh_t(s * (T(1) / static_cast<T>(cap)));
    return T(1) - t * t;
  }
};
// Learnable relative-position bias: score + bias[h, kv_idx - q_idx + (L - 1)], the table being
// f32 [H, L + S - 1] (2S - 1 when L == S), H the query heads. Bound by the front end from
// FlexOptions::bias; its gradient is computed deterministically.
struct RelativePositionBias {
  static constexpr bool kLearnable = true;
  const float* bias = nullptr;
  int64_t row = 0;     // L + S - 1
  int64_t offset = 0;  // L - 1
  KILN_HD int64_t bias_index(int, int h, int q, int kv) const {
    return static_cast<int64_t>(h) * row + (static_cast<int64_t>(kv) - q) + offset;
  }
  template <class T> KILN_HD T operator()(T s, int b, int h, int q, int kv) const {
    return s + static_cast<T>(bias[bias_index(b, h, q, kv)]);
  }
  template <class T> KILN_HD T dscore(T, int, int, int, int) const { return T(1); }
};

}  // namespace kiln::attention
