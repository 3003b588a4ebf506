// CPU body of the fused linear + cross-entropy (kiln/kernels/lce.h): token chunks, the three
// products on the CPU's f32 product (kernels/cpu/sgemm.h: kiln's kernel or OpenBLAS) or OpenBLAS's
// dgemm, one OpenMP row pass per chunk. Memory: one chunk buffer of chunk_tokens × V
// accumulation-type values (chunk_tokens = max(1, 12 Mi / V), so ≤ 48 MiB f32 unless one row alone
// is larger), plus, for 16-bit inputs, f32 copies of hidden and weight.
// Deterministic: each row is reduced by one thread in a fixed order (kernels/cpu/lce_rows.h: the
// row loops, SVE on aarch64 cores that have it), products are calls in a fixed chunk order,
// bias gradients are column sums in row order.
#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "kiln/kernels/copy.h"
#include "kiln/kernels/cpu/lce_rows.h"
#include "kiln/kernels/cpu/loops.h"
#include "kiln/kernels/cpu/sgemm.h"
#include "kiln/kernels/lce.h"

namespace kiln::kernels::cpu {
namespace {

constexpr int64_t kChunkElems = int64_t{12} << 20;  // 12 Mi values: 48 MiB in f32

// Row-major C[m×n] = op(A)·op(B) + beta·C.
template <class A>
void gemm_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const A* a, int64_t lda, const A* b, int64_t ldb,
             A beta, A* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if constexpr (std::is_same_v<A, float>)
    sgemm({m, n, k, ta, tb, a, lda, b, ldb, c, ldc, beta});
  else
    cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(m), int(n), int(k),
                1.0, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

// The tensor itself when it already has dtype `acc`, else a converted copy.
Tensor as_dtype(const Tensor& t, DType acc) {
  if (!t.defined() || t.dtype() == acc) return t;
  Tensor f = Tensor::empty(t.shape(), acc, t.device());
  copy(f, t);
  return f;
}

template <class A, class I>
void run(const LceParams& p, const LceTensors& t) {
  const DType acc = dtype_of<A>;
  const int64_t n = p.n, d = p.d, v = p.v;
  Tensor Ht = as_dtype(t.hidden, acc), Wt = as_dtype(t.weight, acc);
  Tensor Bt = as_dtype(t.bias, acc), CWt = as_dtype(t.class_weight, acc);
  const A* H = Ht.data<A>();
  const A* W = Wt.data<A>();
  const A* bias = Bt.defined() ? Bt.data<A>() : nullptr;
  const A* cw = CWt.defined() ? CWt.data<A>() : nullptr;
  const A* rs = t.row_scale.defined() ? t.row_scale.data<A>() : nullptr;
  const I* tgt = t.target.data<I>();
  const double grad_scale = p.grad_scale * (t.grad_scale.defined() ? *t.grad_scale.data<double>() : 1.0);
  A* loss = t.loss.data<A>();
  A* zloss = t.zloss.data<A>();
  A* lse_out = t.lse.data<A>();
  A* gh = t.grad_hidden.defined() ? t.grad_hidden.data<A>() : nullptr;
  A* gw = t.grad_weight.defined() ? t.grad_weight.data<A>() : nullptr;
  A* gb = t.grad_bias.defined() ? t.grad_bias.data<A>() : nullptr;
  const bool grads = gh || gw || gb;
  const A cap = static_cast<A>(p.softcap);
  const A eps = static_cast<A>(p.label_smoothing);
  const A filter = static_cast<A>(p.filter_eps);

  const int64_t tc = p.chunk_tokens > 0 ? std::min(p.chunk_tokens, n)
                                        : std::clamp<int64_t>(kChunkElems / std::max<int64_t>(v, 1), 1, n);
  Tensor buf_t = Tensor::empty({tc, v}, acc, t.hidden.device());
  A* buf = buf_t.data<A>();

  for (int64_t r0 = 0; r0 < n; r0 += tc) {
    const int64_t m = std::min(tc, n - r0);
    const A* hc = H + r0 * d;
    gemm_rm<A>(false, true, m, v, d, hc, d, W, d, A(0), buf, v);
    parallel_for(m, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t r = r0 + i;
        A* z = buf + i * v;
        const A mx = lce_rows::logits_max(z, bias, v, cap);
        const int64_t tg = static_cast<int64_t>(tgt[r]);
        const bool ignored = tg == p.ignore_index;
        const A zt = ignored ? A(0) : z[tg];
        const A wz = eps != A(0) ? lce_rows::weighted_sum(cw, z, v) : A(0);
        // Without softcap and when gradients follow, keep exp(z − max) in the row so that the
        // gradient pass needs no second exp (z itself is not needed again).
        const bool keep_exp = grads && cap == A(0);
        const A sum = lce_rows::exp_sum(z, v, mx, keep_exp);
        const A lse = mx + std::log(sum);
        const A wt = ignored ? A(0) : (cw ? cw[tg] : A(1));
        const LceRowTerms<A> rt = lce_row_terms<A>(p, lse, zt, wz, wt, ignored);
        loss[r] = rt.ce + rt.zl;
        zloss[r] = rt.zl;
        lse_out[r] = lse;
        if (!grads) continue;
        const A scale = static_cast<A>(grad_scale) * (rs ? rs[r] : A(1));
        if (ignored || scale == A(0)) {
          std::fill(z, z + v, A(0));
          continue;
        }
        lce_rows::GradRow<A> g;
        g.terms = rt, g.w = cw, g.target = tg, g.inv_sum = A(1) / sum, g.lse = lse, g.cap = cap, g.filter = filter;
        g.scale = scale, g.keep_exp = keep_exp;
        lce_rows::grad_row(z, v, g);
      }
    });
    if (!grads) continue;
    if (gh) gemm_rm<A>(false, false, m, d, v, buf, v, W, d, A(0), gh + r0 * d, d);
    if (gw) gemm_rm<A>(true, false, v, d, m, buf, v, hc, d, A(1), gw, d);
    if (gb)
      parallel_for(v, 4096, [&](int64_t b, int64_t e) {
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = b; j < e; ++j) gb[j] += buf[i * v + j];
      });
  }
}

}  // namespace

void linear_cross_entropy(const LceParams& p, const LceTensors& t) {
  if (p.n == 0) return;
  dispatch_floating(t.weight.dtype(), "linear_cross_entropy", [&]<class T>() {
    using A = acc_t<T>;
    dispatch_index(t.target.dtype(), "linear_cross_entropy", [&]<class I>() { run<A, I>(p, t); });
  });
}

}  // namespace kiln::kernels::cpu
