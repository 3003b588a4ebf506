// CPU bodies of the optimizer kernels (update math in kernels/optim.h): the per-parameter
// updates, the multi-tensor ones (one parallel loop over pieces of every parameter of the list),
// the per-chunk partial norms for clip_grad_norm_ and their multi-tensor form, and the fused
// clip's sum of the partials (NOTE [multi-tensor step], kernels/optim.h).
// Compiled with -fno-math-errno (CMakeLists.txt): sqrt never sets errno here (its arguments are
// sums of squares), and without errno GCC vectorises the update loops (sqrtps rounds as sqrtss
// does: the same bits). GCC 12 ignores the option as a pragma.
#include "kiln/kernels/optim.h"

#include <algorithm>
#include <cmath>

#include "kiln/core/dtype.h"
#include "kiln/kernels/cpu/isa/isa.h"  // KILN_SVE_SEAM: the SVE set on aarch64, nothing on x86
#include "kiln/kernels/cpu/loops.h"

namespace kiln::kernels::cpu {
namespace {

// A multi-tensor update splits each parameter into pieces of at most this many elements, and
// one static parallel loop takes the pieces of all parameters (so small tensors share threads
// and large ones spread over all of them).
constexpr int64_t kPiece = 32768;

// Elements [0, n) of one AdamW update, gradients multiplied by `scale` (1: as given, no
// multiply). One loop for both: the fused clipped step (scale = the clip's coefficient) and
// clip_grad_norm_ then step() (g *= scale in place, then scale 1) give the same bits, since the
// product is the same f32 multiply and what follows is the same code. On aarch64 the seam hands
// both to the SVE set, which takes the scale too (a clipped step running the portable loop and an
// unclipped one the SVE loop gave different bits: GCC contracts the portable loop into other
// fused multiply-adds than the SVE one uses).
template <class G>
void adamw_span(float* p, float* m, float* v, const G* g, int64_t n, const AdamWStep& s, float scale) {
  if constexpr (std::is_same_v<G, float>) KILN_SVE_SEAM(adamw_f32, p, m, v, g, n, s, scale);
  else KILN_SVE_SEAM(adamw_bf16, p, m, v, reinterpret_cast<const uint16_t*>(g), n, s, scale);
  if (scale == 1.0f) {
    for (int64_t i = 0; i < n; ++i) adamw_update(p[i], m[i], v[i], static_cast<float>(g[i]), s);
    return;
  }
  for (int64_t i = 0; i < n; ++i) adamw_update(p[i], m[i], v[i], static_cast<float>(g[i]) * scale, s);
}

template <class G>
void sgd_span(float* p, float* buf, const G* g, int64_t n, const SgdStep& s, float scale) {
  if (scale == 1.0f) {
    for (int64_t i = 0; i < n; ++i) sgd_update(p[i], buf ? buf + i : nullptr, static_cast<float>(g[i]), s);
    return;
  }
  for (int64_t i = 0; i < n; ++i) sgd_update(p[i], buf ? buf + i : nullptr, static_cast<float>(g[i]) * scale, s);
}

// One chunk of a gradient's partial norm: sum |g|^p (or max |g|) over [b, e) in double. The 2-
// and 1-norms keep 8 running sums (element i in sum i % 8, each in index order) added in a fixed
// tree at the end: independent sums the compiler vectorises, where one running sum was a chain
// of dependent additions (the clip's norm then took longer than the AdamW update). The bits
// depend on the chunk alone, never on threads. The other norms run one element after another.
template <class T>
double norm_chunk(const T* g, int64_t b, int64_t e, int mode, double norm_type) {
  auto abs_of = [&](int64_t i) { return std::fabs(static_cast<double>(static_cast<acc_t<T>>(g[i]))); };
  if (mode == kNormL2 || mode == kNormL1) {
    constexpr int kLanes = 8;
    double acc[kLanes] = {};
    int64_t i = b;
    if (mode == kNormL2) {
      for (; i + kLanes <= e; i += kLanes)
        for (int j = 0; j < kLanes; ++j) {
          const double a = abs_of(i + j);
          acc[j] += a * a;
        }
      for (int j = 0; i < e; ++i, ++j) acc[j] += abs_of(i) * abs_of(i);
    } else {
      for (; i + kLanes <= e; i += kLanes)
        for (int j = 0; j < kLanes; ++j) acc[j] += abs_of(i + j);
      for (int j = 0; i < e; ++i, ++j) acc[j] += abs_of(i);
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  double acc = 0;
  for (int64_t i = b; i < e; ++i) {
    const double a = abs_of(i);
    if (mode == kNormInf) acc = (a != a || a > acc) ? a : acc;  // NaN sticks
    else acc += std::pow(a, norm_type);
  }
  return acc;
}

// The clip's scale for an update: 1 without a clip; false when the step is skipped.
bool clip_scale_of(const Tensor& clip, float& scale) {
  scale = 1.0f;
  if (!clip.defined()) return true;
  const double* c = clip.data<double>();
  if (!std::isfinite(c[0])) return false;
  scale = static_cast<float>(c[1]);
  return true;
}

// Calls f(slot, begin, count) for every piece of kPiece elements of every slot: one static
// parallel loop over the pieces of all slots, in slot order.
template <class Slot, class F>
void for_each_piece(const std::vector<Slot>& slots, F&& f) {
  struct Piece {
    size_t slot;
    int64_t b, e;
  };
  std::vector<Piece> pieces;
  for (size_t k = 0; k < slots.size(); ++k)
    for (int64_t b = 0; b < slots[k].n; b += kPiece) pieces.push_back({k, b, std::min(slots[k].n, b + kPiece)});
  parallel_for(static_cast<int64_t>(pieces.size()), 1, [&](int64_t kb, int64_t ke) {
    for (int64_t k = kb; k < ke; ++k) {
      const Piece& pc = pieces[static_cast<size_t>(k)];
      f(slots[pc.slot], pc.b, pc.e - pc.b);
    }
  });
}

}  // namespace

void adamw(const AdamWStep& s, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
           const Tensor& exp_avg_sq) {
  float* p = param.data<float>();
  float* m = exp_avg.data<float>();
  float* v = exp_avg_sq.data<float>();
  dispatch_grad(grad.dtype(), "adamw", [&]<class G>() {
    const G* g = static_cast<const G*>(grad.data_ptr());
    parallel_for(param.numel(), kParallelGrain,
                 [&](int64_t b, int64_t e) { adamw_span(p + b, m + b, v + b, g + b, e - b, s, 1.0f); });
  });
}

void sgd(const SgdStep& s, const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer) {
  float* p = param.data<float>();
  float* buf = momentum_buffer.defined() ? momentum_buffer.data<float>() : nullptr;
  dispatch_grad(grad.dtype(), "sgd", [&]<class G>() {
    const G* g = static_cast<const G*>(grad.data_ptr());
    parallel_for(param.numel(), kParallelGrain,
                 [&](int64_t b, int64_t e) { sgd_span(p + b, buf ? buf + b : nullptr, g + b, e - b, s, 1.0f); });
  });
}

void adamw_multi(Device, const std::vector<AdamWSlot>& slots, const Tensor& clip) {
  float scale;
  if (!clip_scale_of(clip, scale)) return;
  for_each_piece(slots, [&](const AdamWSlot& sl, int64_t b, int64_t n) {
    if (sl.grad_bf16) adamw_span(sl.p + b, sl.m + b, sl.v + b, static_cast<const BFloat16*>(sl.g) + b, n, sl.s, scale);
    else adamw_span(sl.p + b, sl.m + b, sl.v + b, static_cast<const float*>(sl.g) + b, n, sl.s, scale);
  });
}

void sgd_multi(Device, const std::vector<SgdSlot>& slots, const Tensor& clip) {
  float scale;
  if (!clip_scale_of(clip, scale)) return;
  for_each_piece(slots, [&](const SgdSlot& sl, int64_t b, int64_t n) {
    float* buf = sl.buf ? sl.buf + b : nullptr;
    if (sl.grad_bf16) sgd_span(sl.p + b, buf, static_cast<const BFloat16*>(sl.g) + b, n, sl.s, scale);
    else sgd_span(sl.p + b, buf, static_cast<const float*>(sl.g) + b, n, sl.s, scale);
  });
}

void grad_norm_partials(const Tensor& grad, double norm_type, const Tensor& partials) {
  const int64_t n = grad.numel();
  const int64_t chunks = norm_partials_count(n);
  double* out = partials.data<double>();
  const int mode = norm_mode(norm_type);
  dispatch_floating(grad.dtype(), "clip_grad_norm_", [&]<class T>() {
    const T* g = static_cast<const T*>(grad.data_ptr());
    parallel_for(chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c)
        out[c] = norm_chunk(g, c * kNormChunk, std::min(n, (c + 1) * kNormChunk), mode, norm_type);
    });
  });
}

void grad_norm_partials_multi(Device, const std::vector<NormSlot>& slots, double norm_type, const Tensor& partials) {
  // first[k]: slot k's first partial; first.back(): all of them.
  std::vector<int64_t> first(slots.size() + 1, 0);
  for (size_t k = 0; k < slots.size(); ++k) first[k + 1] = first[k] + norm_partials_count(slots[k].n);
  KILN_CHECK(partials.numel() == first.back(), "grad_norm_partials_multi: partials has ", partials.numel(),
             " elements, the slots need ", first.back());
  double* out = partials.data<double>();
  const int mode = norm_mode(norm_type);
  parallel_for(first.back(), 1, [&](int64_t cb, int64_t ce) {
    // The slot holding partial cb (past empty slots, whose runs are empty), then walk on.
    size_t k = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), cb) - first.begin()) - 1;
    for (int64_t c = cb; c < ce; ++c) {
      while (c >= first[k + 1]) ++k;
      const NormSlot& sl = slots[k];
      const int64_t b = (c - first[k]) * kNormChunk, e = std::min(sl.n, b + kNormChunk);
      out[c] = sl.grad_bf16 ? norm_chunk(static_cast<const BFloat16*>(sl.g), b, e, mode, norm_type)
                            : norm_chunk(static_cast<const float*>(sl.g), b, e, mode, norm_type);
    }
  });
}

void clip_from_partials(const Tensor& partials, double norm_type, double max_norm, const Tensor& clip) {
  const double* v = partials.data<double>();
  const int64_t n = partials.numel();
  const int mode = norm_mode(norm_type);
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (mode == kNormInf) acc = (v[i] != v[i] || v[i] > acc) ? v[i] : acc;
    else acc += v[i];
  }
  const double norm = norm_from_sum(acc, mode, norm_type);
  double* c = clip.data<double>();
  c[0] = norm;
  c[1] = std::isfinite(norm) ? clip_scale(norm, max_norm) : 1.0;
}

}  // namespace kiln::kernels::cpu
