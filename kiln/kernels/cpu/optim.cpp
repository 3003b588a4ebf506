// CPU bodies of the optimizer kernels (update math in kernels/optim.h): one parallel pass per
// parameter, and per-chunk partial norms for clip_grad_norm_.
#include "kiln/kernels/optim.h"

#include <cmath>

#include "kiln/core/dtype.h"
#include "kiln/kernels/cpu/isa/isa.h"  // KILN_SVE_SEAM: the SVE set on aarch64, nothing on x86
#include "kiln/kernels/cpu/loops.h"

namespace kiln::kernels::cpu {
void adamw(const AdamWStep& s, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
           const Tensor& exp_avg_sq) {
  float* p = param.data<float>();
  float* m = exp_avg.data<float>();
  float* v = exp_avg_sq.data<float>();
  dispatch_grad(grad.dtype(), "adamw", [&]<class G>() {
    const G* g = static_cast<const G*>(grad.data_ptr());
    parallel_for(param.numel(), kParallelGrain, [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<G, float>) KILN_SVE_SEAM(adamw_f32, p + b, m + b, v + b, g + b, e - b, s);
      if constexpr (std::is_same_v<G, BFloat16>)
        KILN_SVE_SEAM(adamw_bf16, p + b, m + b, v + b, reinterpret_cast<const uint16_t*>(g + b), e - b, s);
      for (int64_t i = b; i < e; ++i) adamw_update(p[i], m[i], v[i], static_cast<float>(g[i]), s);
    });
  });
}

void sgd(const SgdStep& s, const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer) {
  float* p = param.data<float>();
  float* buf = momentum_buffer.defined() ? momentum_buffer.data<float>() : nullptr;
  dispatch_grad(grad.dtype(), "sgd", [&]<class G>() {
    const G* g = static_cast<const G*>(grad.data_ptr());
    parallel_for(param.numel(), kParallelGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sgd_update(p[i], buf ? buf + i : nullptr, static_cast<float>(g[i]), s);
    });
  });
}

void grad_norm_partials(const Tensor& grad, double norm_type, const Tensor& partials) {
  const int64_t n = grad.numel();
  const int64_t chunks = norm_partials_count(n);
  double* out = partials.data<double>();
  const bool inf_norm = std::isinf(norm_type);
  dispatch_floating(grad.dtype(), "clip_grad_norm_", [&]<class T>() {
    const T* g = static_cast<const T*>(grad.data_ptr());
    parallel_for(chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t b = c * kNormChunk, e = std::min(n, b + kNormChunk);
        double acc = 0;
        for (int64_t i = b; i < e; ++i) {
          const double a = std::fabs(static_cast<double>(static_cast<acc_t<T>>(g[i])));
          if (inf_norm) acc = (a != a || a > acc) ? a : acc;  // NaN sticks
          else if (norm_type == 2.0) acc += a * a;
          else if (norm_type == 1.0) acc += a;
          else acc += std::pow(a, norm_type);
        }
        out[c] = acc;
      }
    });
  });
}

}  // namespace kiln::kernels::cpu
