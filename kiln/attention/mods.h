// FlexAttention modifiers: the C++20 concepts that check score_mod and mask_mod functors, and
// the host helpers (alibi_slopes). The functors themselves (the library: noop, causal, sliding
// window, document, prefix LM, ALiBi, softcap, learnable relative-position bias, and_masks /
// or_masks) are device-only, in kiln/kernels/flex_mods.h (NOTE [flex mods] there).
#pragma once
#include <cmath>
#include <concepts>
#include <cstdint>

#include "kiln/kernels/flex_mods.h"

namespace kiln::attention {

template <class M>
concept MaskMod = std::copy_constructible<M> && requires(const M& m, int b, int h, int q, int kv) {
  { m(b, h, q, kv) } -> std::convertible_to<bool>;
};

template <class S>
concept ScoreMod = std::copy_constructible<S> && requires(const S& s, float xf, double xd, int i) {
  { s(xf, i, i, i, i) } -> std::convertible_to<float>;
  { s(xd, i, i, i, i) } -> std::convertible_to<double>;
  { s.dscore(xf, i, i, i, i) } -> std::convertible_to<float>;
  { s.dscore(xd, i, i, i, i) } -> std::convertible_to<double>;
};

// A score_mod with a learnable table: score' = f(score) + table[bias_index(...)].
template <class S>
concept LearnableScoreMod = ScoreMod<S> && S::kLearnable && requires(const S& s, int i) {
  { s.bias_index(i, i, i, i) } -> std::convertible_to<int64_t>;
};

template <MaskMod A, MaskMod B> AndMask<A, B> and_masks(A a, B b) { return {a, b}; }
template <MaskMod A, MaskMod B> OrMask<A, B> or_masks(A a, B b) { return {a, b}; }
template <MaskMod A, MaskMod B, MaskMod C, MaskMod... R>
auto and_masks(A a, B b, C c, R... r) { return and_masks(and_masks(a, b), c, r...); }
template <MaskMod A, MaskMod B, MaskMod C, MaskMod... R>
auto or_masks(A a, B b, C c, R... r) { return or_masks(or_masks(a, b), c, r...); }

// The geometric ALiBi slopes of the paper for `heads` heads, written to out[0..heads).
inline void alibi_slopes(int heads, float* out) {
  double start = std::pow(2.0, -8.0 / heads);
  for (int h = 0; h < heads; ++h) out[h] = static_cast<float>(std::pow(start, h + 1));
}
static_assert(MaskMod<NoMask> && MaskMod<Causal> && MaskMod<SlidingWindow> && MaskMod<Document> &&
              MaskMod<PrefixLM> && MaskMod<DocumentCausal>);
static_assert(ScoreMod<NoScoreMod> && ScoreMod<Alibi> && ScoreMod<Softcap> && LearnableScoreMod<RelativePositionBias>);

}  // namespace kiln::attention
