// CPU bodies of the neural-network kernels (kernels/nn.h): embedding gather and deterministic
// scatter-add, fused RMSNorm forward/backward, rotary embedding, cross-entropy rows, dropout
// mask, fused SwiGLU forward/backward. Accumulation is in double (f32 cross-entropy rows take
// f32 exps: vec_math.h); every reduction has a fixed order independent of threads.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/kernels/cpu/isa/isa.h"  // KILN_SVE_SEAM: the SVE set on aarch64, nothing on x86
#include "kiln/kernels/cpu/loops.h"
#include "kiln/kernels/cpu/vec_math.h"
#include "kiln/kernels/elementwise.h"
#include "kiln/kernels/nn.h"

namespace kiln::kernels::cpu {
namespace {

// Reads ids of either index dtype as int64.
template <class F>
void with_ids(const Tensor& ids, F&& f) {
  dispatch_index(ids.dtype(), "ids", [&]<class I>() {
    const I* p = static_cast<const I*>(ids.data_ptr());
    f([p](int64_t i) { return static_cast<int64_t>(p[i]); });
  });
}

// Rows per block for the per-block partial sums of a column reduction: fixed, so the
// summation order never depends on the thread count.
constexpr int64_t kRowsPerBlock = 64;

}  // namespace

int64_t first_out_of_range(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore) {
  int64_t bad = -1;
  with_ids(ids, [&](auto at) {
    for (int64_t i = 0, n = ids.numel(); i < n; ++i) {
      int64_t v = at(i);
      if ((v < lo || v >= hi) && v != ignore) {
        bad = i;
        return;
      }
    }
  });
  return bad;
}

void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& ids) {
  const int64_t n = ids.numel(), d = weight.size(1);
  dispatch_floating(weight.dtype(), "embedding", [&]<class T>() {
    const T* w = static_cast<const T*>(weight.data_ptr());
    T* y = static_cast<T*>(out.data_ptr());
    with_ids(ids, [&](auto at) {
      parallel_for(n, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) std::copy(w + at(i) * d, w + at(i) * d + d, y + i * d);
      });
    });
  });
}

void embedding_backward(const Tensor& dweight, const Tensor& grad, const Tensor& ids) {
  const int64_t n = ids.numel(), v = dweight.size(0), d = dweight.size(1);
  // Counting sort of positions by id (stable: positions of one id stay in increasing order).
  std::vector<int64_t> start(static_cast<size_t>(v + 1), 0), order(static_cast<size_t>(n));
  with_ids(ids, [&](auto at) {
    for (int64_t i = 0; i < n; ++i) ++start[static_cast<size_t>(at(i) + 1)];
    for (int64_t r = 0; r < v; ++r) start[static_cast<size_t>(r + 1)] += start[static_cast<size_t>(r)];
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(fill[static_cast<size_t>(at(i))]++)] = i;
  });
  dispatch_floating(dweight.dtype(), "embedding_backward", [&]<class T>() {
    const T* g = static_cast<const T*>(grad.data_ptr());
    T* dw = static_cast<T*>(dweight.data_ptr());
    // One owner per vocabulary row.
    parallel_for(v, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
      std::vector<double> acc(static_cast<size_t>(d));
      for (int64_t r = b; r < e; ++r) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t k = start[static_cast<size_t>(r)]; k < start[static_cast<size_t>(r + 1)]; ++k) {
          const T* gi = g + order[static_cast<size_t>(k)] * d;
          for (int64_t c = 0; c < d; ++c) acc[static_cast<size_t>(c)] += static_cast<double>(gi[c]);
        }
        for (int64_t c = 0; c < d; ++c) dw[r * d + c] = T(static_cast<acc_t<T>>(acc[static_cast<size_t>(c)]));
      }
    });
  });
}

void rms_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight, double eps) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  dispatch_floating(x.dtype(), "rms_norm", [&]<class T>() {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;  // stats dtype
    const T* px = static_cast<const T*>(x.data_ptr());
    const T* pw = static_cast<const T*>(weight.data_ptr());
    T* py = static_cast<T*>(out.data_ptr());
    S* pr = static_cast<S*>(rstd.data_ptr());
    parallel_for(rows, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<T, float>) {
        KILN_SVE_SEAM(rms_norm_rows_f32, py + b * d, pr + b, px + b * d, pw, e - b, d, eps);
        return rms_norm_rows_f32(py + b * d, pr + b, px + b * d, pw, e - b, d, eps);  // vec_math.h
      }
      for (int64_t r = b; r < e; ++r) {
        const T* xr = px + r * d;
        double ss = 0;
        for (int64_t c = 0; c < d; ++c) ss += static_cast<double>(xr[c]) * static_cast<double>(xr[c]);
        double rs = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
        pr[r] = static_cast<S>(rs);
        for (int64_t c = 0; c < d; ++c)
          py[r * d + c] = T(static_cast<acc_t<T>>(static_cast<double>(xr[c]) * rs * static_cast<double>(pw[c])));
      }
    });
  });
}

void rms_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                       const Tensor& weight, const Tensor& rstd) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  std::vector<double> partial(dweight.defined() ? static_cast<size_t>(blocks * d) : 0, 0.0);
  dispatch_floating(x.dtype(), "rms_norm_backward", [&]<class T>() {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* px = static_cast<const T*>(x.data_ptr());
    const T* pg = static_cast<const T*>(dy.data_ptr());
    const T* pw = static_cast<const T*>(weight.data_ptr());
    const S* pr = static_cast<const S*>(rstd.data_ptr());
    T* pdx = static_cast<T*>(dx.data_ptr());
    const bool want_dw = dweight.defined();
    parallel_for(blocks, 1, [&](int64_t bb, int64_t be) {
      for (int64_t blk = bb; blk < be; ++blk) {
        double* part = want_dw ? partial.data() + blk * d : nullptr;
#if KILN_ISA_SEAMS
        if constexpr (std::is_same_v<T, float>) {
          if (const auto* k = isa::sve()) {
            isa::count_sve_call();
            k->rms_norm_backward_rows_f32(pdx, part, pg, px, pw, pr, blk * kRowsPerBlock,
                                          std::min(rows, (blk + 1) * kRowsPerBlock), d);
            continue;
          }
        }
#endif
        if constexpr (std::is_same_v<T, float>) {  // vec_math.h
          rms_norm_backward_rows_f32(pdx, part, pg, px, pw, pr, blk * kRowsPerBlock,
                                     std::min(rows, (blk + 1) * kRowsPerBlock), d);
          continue;
        }
        for (int64_t r = blk * kRowsPerBlock; r < std::min(rows, (blk + 1) * kRowsPerBlock); ++r) {
          const T* xr = px + r * d;
          const T* gr = pg + r * d;
          double rs = static_cast<double>(pr[r]);
          double dot = 0;  // sum_c dy*w*x
          for (int64_t c = 0; c < d; ++c)
            dot += static_cast<double>(gr[c]) * static_cast<double>(pw[c]) * static_cast<double>(xr[c]);
          double k = dot * rs * rs * rs / static_cast<double>(d);
          for (int64_t c = 0; c < d; ++c) {
            double xc = static_cast<double>(xr[c]), gc = static_cast<double>(gr[c]);
            pdx[r * d + c] = T(static_cast<acc_t<T>>(gc * static_cast<double>(pw[c]) * rs - xc * k));
            if (part) part[c] += gc * xc * rs;
          }
        }
      }
    });
    if (want_dw) {
      T* pdw = static_cast<T*>(dweight.data_ptr());
      for (int64_t c = 0; c < d; ++c) {
        double s = 0;
        for (int64_t blk = 0; blk < blocks; ++blk) s += partial[static_cast<size_t>(blk * d + c)];
        pdw[c] = T(static_cast<acc_t<T>>(s));
      }
    }
  });
}

namespace {
// The rows of a tensor whose last dim is its row, walked in order (a flat index over the leading
// dims, row-major) from `row`: offset() is the current row's element offset in the tensor's
// strides; next() steps one row, carrying from the innermost leading dim (no division a row).
class RowCursor {
 public:
  RowCursor(const Tensor& t, int64_t row) : t_(t), index_(static_cast<size_t>(std::max<int64_t>(t.dim() - 1, 0))) {
    for (int64_t d = t.dim() - 2; d >= 0; --d) {
      const int64_t n = t.size(d);
      index_[static_cast<size_t>(d)] = row % n;
      offset_ += (row % n) * t.stride(d);
      row /= n;
    }
  }
  int64_t offset() const { return offset_; }
  void next() {
    for (int64_t d = t_.dim() - 2; d >= 0; --d) {
      offset_ += t_.stride(d);
      if (++index_[static_cast<size_t>(d)] < t_.size(d)) return;
      offset_ -= t_.size(d) * t_.stride(d);
      index_[static_cast<size_t>(d)] = 0;
    }
  }

 private:
  const Tensor& t_;
  std::vector<int64_t> index_;
  int64_t offset_ = 0;
};
}  // namespace

void rotary(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose) {
  KILN_CHECK(x.stride(-1) == 1 && out.stride(-1) == 1, "rotary_embedding: the head dim must be contiguous in x and out");
  const int64_t t = cos.size(0), dd = cos.size(1), half = dd / 2;
  const int64_t rows = (t && dd) ? x.numel() / (t * dd) : 0;
  const float* pc = static_cast<const float*>(cos.data_ptr());
  const float* ps = static_cast<const float*>(sin.data_ptr());
  const bool flat = x.is_contiguous() && out.is_contiguous();
  dispatch_floating(x.dtype(), "rotary_embedding", [&]<class T>() {
    const T* px = static_cast<const T*>(x.data_ptr());
    T* py = static_cast<T*>(out.data_ptr());
    parallel_for(rows * t, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(dd, 1)), [&](int64_t b, int64_t e) {
      RowCursor xc(x, flat ? 0 : b), yc(out, flat ? 0 : b);  // rows of x and out in their strides
      for (int64_t rt = b; rt < e; ++rt, flat ? void() : (xc.next(), yc.next())) {
        const int64_t pos = rt % t;
        const T* xr = px + (flat ? rt * dd : xc.offset());
        T* yr = py + (flat ? rt * dd : yc.offset());
        const float* cr = pc + pos * dd;
        const float* sr = ps + pos * dd;
        if constexpr (std::is_same_v<T, float>) {
          if (dd == 2 * half) {
            rotary_row_f32(yr, xr, cr, sr, half, transpose);  // vectorised, the same bits (vec_math.h)
            continue;
          }
        }
        for (int64_t c = 0; c < dd; ++c) {
          double v = static_cast<double>(xr[c]) * cr[c];
          if (!transpose)
            v += c < half ? -static_cast<double>(xr[c + half]) * sr[c] : static_cast<double>(xr[c - half]) * sr[c];
          else
            v += c < half ? static_cast<double>(xr[c + half]) * sr[c + half] : -static_cast<double>(xr[c - half]) * sr[c - half];
          yr[c] = T(static_cast<acc_t<T>>(v));
        }
      }
    });
  });
}

void cross_entropy_forward(const Tensor& loss, const Tensor& lse, const Tensor& logits, const Tensor& target,
                           int64_t ignore_index, double ls) {
  const int64_t n = logits.size(0), c = logits.size(1);
  dispatch_floating(logits.dtype(), "cross_entropy", [&]<class T>() {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* px = static_cast<const T*>(logits.data_ptr());
    S* pl = static_cast<S*>(loss.data_ptr());
    S* pe = static_cast<S*>(lse.data_ptr());
    with_ids(target, [&](auto at) {
      parallel_for(n, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(c, 1)), [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const T* xr = px + r * c;
          double m = -INFINITY, sum = 0, sx = 0;
          if constexpr (std::is_same_v<T, float>) {  // f32 exps, summed in double (vec_math.h)
            const CeRowSums rs = ce_row_sums_f32(xr, c);
            m = rs.max, sum = rs.sum_exp, sx = rs.sum_x;
          } else {
            for (int64_t k = 0; k < c; ++k) m = std::max(m, static_cast<double>(xr[k]));
            for (int64_t k = 0; k < c; ++k) {
              sum += std::exp(static_cast<double>(xr[k]) - m);
              sx += static_cast<double>(xr[k]);
            }
          }
          double l = m + std::log(sum);
          pe[r] = static_cast<S>(l);
          int64_t tg = at(r);
          if (tg == ignore_index) {
            pl[r] = 0;
            continue;
          }
          double nll = l - static_cast<double>(xr[tg]);
          pl[r] = static_cast<S>((1.0 - ls) * nll + (ls > 0 ? ls * (l - sx / static_cast<double>(c)) : 0.0));
        }
      });
    });
  });
}

void cross_entropy_backward(const Tensor& dlogits, const Tensor& scale, const Tensor& logits, const Tensor& target,
                            const Tensor& lse, int64_t ignore_index, double ls) {
  const int64_t n = logits.size(0), c = logits.size(1);
  dispatch_floating(logits.dtype(), "cross_entropy_backward", [&]<class T>() {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* px = static_cast<const T*>(logits.data_ptr());
    const S* pe = static_cast<const S*>(lse.data_ptr());
    const S* psc = static_cast<const S*>(scale.data_ptr());
    T* pd = static_cast<T*>(dlogits.data_ptr());
    with_ids(target, [&](auto at) {
      parallel_for(n, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(c, 1)), [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const int64_t tg = at(r);
          const double s = tg == ignore_index ? 0.0 : static_cast<double>(psc[r]);
          const double l = static_cast<double>(pe[r]);
          if constexpr (std::is_same_v<T, float>) {  // f32 throughout (vec_math.h)
            ce_grad_row_f32(pd + r * c, px + r * c, c, static_cast<float>(l), tg, static_cast<float>(1.0 - ls),
                            static_cast<float>(ls / static_cast<double>(c)), static_cast<float>(s));
            continue;
          }
          for (int64_t k = 0; k < c; ++k) {
            double p = std::exp(static_cast<double>(px[r * c + k]) - l);
            double v = p - (k == tg ? 1.0 - ls : 0.0) - ls / static_cast<double>(c);
            pd[r * c + k] = T(static_cast<acc_t<T>>(s * v));
          }
        }
      });
    });
  });
}

void dropout_mask(const Tensor& keep, uint64_t seed, uint64_t offset, double p) {
  bool* k = static_cast<bool*>(keep.data_ptr());
  const float pf = static_cast<float>(p);
  parallel_for(keep.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      k[i] = uniform_from_bits(philox_element(seed, offset, static_cast<uint64_t>(i)).v[0]) >= pf;
  });
}

// SwiGLU: f32 through vec_math's vectorised loops (one exp an element), other dtypes through
// swiglu_math per element in their accumulation type.
void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  const int64_t n = out.numel();
  dispatch_floating(out.dtype(), "swiglu", [&]<class T>() {
    T* y = static_cast<T*>(out.data_ptr());
    const T* g = static_cast<const T*>(gate.data_ptr());
    const T* u = static_cast<const T*>(up.data_ptr());
    parallel_for(n, kParallelGrain, [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<T, float>) {
        swiglu_f32(y + b, g + b, u + b, e - b);
      } else {
        using A = acc_t<T>;
        for (int64_t i = b; i < e; ++i) y[i] = T(swiglu_math<A>(static_cast<A>(g[i]), static_cast<A>(u[i])));
      }
    });
  });
}

void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& grad, const Tensor& gate, const Tensor& up) {
  const int64_t n = grad.numel();
  dispatch_floating(grad.dtype(), "swiglu", [&]<class T>() {
    T* dg = static_cast<T*>(dgate.data_ptr());
    T* du = static_cast<T*>(dup.data_ptr());
    const T* d = static_cast<const T*>(grad.data_ptr());
    const T* g = static_cast<const T*>(gate.data_ptr());
    const T* u = static_cast<const T*>(up.data_ptr());
    parallel_for(n, kParallelGrain, [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<T, float>) {
        swiglu_grad_f32(dg + b, du + b, d + b, g + b, u + b, e - b);
      } else {
        using A = acc_t<T>;
        for (int64_t i = b; i < e; ++i) {
          A a, c;
          swiglu_grad_math<A>(static_cast<A>(d[i]), static_cast<A>(g[i]), static_cast<A>(u[i]), a, c);
          dg[i] = T(a), du[i] = T(c);
        }
      }
    });
  });
}

}  // namespace kiln::kernels::cpu
