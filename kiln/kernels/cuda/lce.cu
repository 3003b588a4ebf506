// CUDA body of the fused linear + cross-entropy (kiln/kernels/lce.h). Gradients are computed
// inside the forward, so the whole step costs three GEMMs, no logits recomputation:
//   per token chunk of m rows (m·V·sizeof(T) ≤ 128 MiB, a multiple of 64 tokens):
//   1. logits[m, V] = h_c · Wᵀ           cuBLASLt, T in, f32 compute, T out (reused buffer)
//   2. one block per row: online max/sum → lse; loss terms (smoothing, z-loss, softcap,
//      class weights, ignore); then dz written in place over the row, times the row's scale
//   3. d_hidden[c] = dz · W               cuBLASLt (rows of a chunk are disjoint: written once)
//   4. d_weight  += dzᵀ · h_c             cuBLASLt with beta = 1, in a fixed chunk order
//   5. d_bias    += column sums of dz     one thread per column, rows in order (f32)
// d_weight accumulation: by default in the weight's dtype (16-bit: one rounding per chunk of
// an f32-computed GEMM; see docs/loss.md for the error); LceTensors.grad_weight in f32 gives
// exact-order f32 accumulation at V·d·4 bytes. Deterministic: no atomics; in deterministic mode
// cuBLASLt is kept off split-K schemes that reduce with atomics.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>

#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/lce.h"

namespace kiln::kernels::cuda {
namespace {

constexpr int kRowThreads = 512;
constexpr int64_t kChunkBytes = int64_t{128} << 20;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Merges two (max, sum of exp(x − max)) pairs.
__device__ __forceinline__ void merge_ms(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) { m = m2; s = s2; return; }
  if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; }
  else s += s2 * expf(m2 - m);
}

// Block-wide reduction of (max, sum) and a plain sum, in a fixed order (deterministic).
__device__ void block_reduce(float& m, float& s, float& w) {
  __shared__ float sm[32], ss[32], sw[32];
  for (int off = 16; off > 0; off >>= 1) {
    float m2 = __shfl_down_sync(0xffffffffu, m, off), s2 = __shfl_down_sync(0xffffffffu, s, off);
    w += __shfl_down_sync(0xffffffffu, w, off);
    merge_ms(m, s, m2, s2);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane == 0) { sm[warp] = m; ss[warp] = s; sw[warp] = w; }
  __syncthreads();
  if (warp == 0) {
    m = lane < nwarps ? sm[lane] : -INFINITY;
    s = lane < nwarps ? ss[lane] : 0.f;
    w = lane < nwarps ? sw[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) {
      float m2 = __shfl_down_sync(0xffffffffu, m, off), s2 = __shfl_down_sync(0xffffffffu, s, off);
      w += __shfl_down_sync(0xffffffffu, w, off);
      merge_ms(m, s, m2, s2);
    }
    if (lane == 0) { sm[0] = m; ss[0] = s; sw[0] = w; }
  }
  __syncthreads();
  m = sm[0]; s = ss[0]; w = sw[0];
}

template <class T, class I>
__global__ void __launch_bounds__(kRowThreads) lce_rows(LceParams p, T* __restrict__ logits, int64_t r0,
                                                      const T* __restrict__ bias, const T* __restrict__ cw,
                                                      const I* __restrict__ tgt, const float* __restrict__ row_scale,
                                                      float* __restrict__ loss, float* __restrict__ zloss,
                                                      float* __restrict__ lse_out, bool grads) {
  const int64_t i = blockIdx.x, r = r0 + i, v = p.v;
  T* z = logits + i * v;
  const float cap = static_cast<float>(p.softcap);
  const bool smooth = p.label_smoothing != 0.0;
  auto logit = [&](int64_t j) {
    float x = to_f(z[j]);
    if (bias) x += to_f(bias[j]);
    return lce_cap(x, cap);
  };
  float m = -INFINITY, s = 0.f, wz = 0.f;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const float x = logit(j);
    merge_ms(m, s, x, 1.f);
    if (smooth) wz += (cw ? to_f(cw[j]) : 1.f) * x;
  }
  block_reduce(m, s, wz);
  const float lse = m + logf(s);
  const int64_t t = static_cast<int64_t>(tgt[r]);
  const bool ignored = t == p.ignore_index;
  const float zt = ignored ? 0.f : logit(t);
  const float wt = ignored ? 0.f : (cw ? to_f(cw[t]) : 1.f);
  const LceRowTerms<float> rt = lce_row_terms<float>(p, lse, zt, wz, wt, ignored);
  if (threadIdx.x == 0) {
    loss[r] = rt.ce + rt.zl;
    zloss[r] = rt.zl;
    lse_out[r] = lse;
  }
  if (!grads) return;
  const float scale = static_cast<float>(p.grad_scale) * (row_scale ? row_scale[r] : 1.f);
  const bool zero = ignored || scale == 0.f;
  const float filter = static_cast<float>(p.filter_eps);
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    float g = 0.f;
    if (!zero) {
      const float x = logit(j);
      g = expf(x - lse) * rt.p_coef - (cw ? to_f(cw[j]) : 1.f) * rt.smooth_coef;
      if (j == t) g -= rt.target_coef;
      if (filter > 0.f && fabsf(g) < filter) g = 0.f;
      g *= lce_cap_deriv(x, cap) * scale;
    }
    z[j] = from_f<T>(g);
  }
}

// gb[j] += Σ_i g[i, j] over the chunk's rows, in row order.
template <class T>
__global__ void lce_bias_grad(const T* __restrict__ g, int64_t m, int64_t v, float* __restrict__ gb) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= v) return;
  float acc = gb[j];
  for (int64_t i = 0; i < m; ++i) acc += to_f(g[i * v + j]);
  gb[j] = acc;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: fail("linear_cross_entropy: dtype ", dtype_name(t), " is not supported on CUDA (f32, bf16, f16)");
  }
}

void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) fail("linear_cross_entropy: ", what, " failed (cublasStatus ", int(s), ")");
}

// The largest power of two (≤ 256) dividing the address.
uint32_t alignment_of(const void* p) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p) | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// Column-major D[M×N] = op(A)·op(B) + beta·D, f32 compute.
void lt_gemm(DeviceContext& ctx, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A,
             cudaDataType_t at, int64_t lda, const void* B, cudaDataType_t bt, int64_t ldb, void* C, cudaDataType_t ct,
             int64_t ldc, float beta) {
  if (M == 0 || N == 0) return;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa));
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb));
  lt_check(cublasLtMatrixLayoutCreate(&la, at, ta ? K : M, ta ? M : K, lda), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&lb, bt, tb ? N : K, tb ? K : N, ldb), "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&lc, ct, M, N, ldc), "layout C");
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  size_t ws = ctx.workspace_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  // The operands' real alignment (chunk offsets need not be 256-byte aligned).
  const uint32_t al_a = alignment_of(A), al_b = alignment_of(B), al_c = alignment_of(C);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c));
  if (deterministic()) {
    // Keep split-K reductions out of the output buffer (the in-place scheme may reduce with atomics).
    uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                    CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask));
  }
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  lt_check(cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt, op, la, lb, lc, lc, pref, 1, &heur, &found),
           "cublasLtMatmulAlgoGetHeuristic");
  KILN_CHECK(found > 0, "linear_cross_entropy: cuBLASLt found no algorithm for a ", M, "x", N, "x", K, " product");
  const float alpha = 1.f;
  lt_check(cublasLtMatmul(ctx.cublaslt, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &heur.algo, ctx.workspace,
                          ctx.workspace_bytes, ctx.stream),
           "cublasLtMatmul");
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
}

template <class T, class I>
void run(const LceParams& p, const LceTensors& t) {
  const int dev = t.hidden.device().index;
  DeviceContext& ctx = context(dev);
  const DType dt = t.hidden.dtype();
  const cudaDataType_t ct = cuda_type(dt);
  const int64_t n = p.n, d = p.d, v = p.v, es = static_cast<int64_t>(itemsize(dt));
  int64_t m = p.chunk_tokens;
  if (m <= 0) {
    m = std::max<int64_t>(1, kChunkBytes / (v * es));
    if (m >= 64) m -= m % 64;
  }
  m = std::min(m, n);
  Tensor buf_t = Tensor::empty({m, v}, dt, t.hidden.device());
  T* buf = static_cast<T*>(buf_t.data_ptr());
  const T* H = static_cast<const T*>(t.hidden.data_ptr());
  const T* W = static_cast<const T*>(t.weight.data_ptr());
  const T* bias = t.bias.defined() ? static_cast<const T*>(t.bias.data_ptr()) : nullptr;
  const T* cw = t.class_weight.defined() ? static_cast<const T*>(t.class_weight.data_ptr()) : nullptr;
  const float* rs = t.row_scale.defined() ? t.row_scale.data<float>() : nullptr;
  const bool grads = t.grad_hidden.defined() || t.grad_weight.defined() || t.grad_bias.defined();
  for (int64_t r0 = 0; r0 < n; r0 += m) {
    const int64_t mm = std::min(m, n - r0);
    const T* hc = H + r0 * d;
    // logits row-major [mm, V] = column-major [V, mm] = W(T) · hcᵀ.
    lt_gemm(ctx, true, false, v, mm, d, W, ct, d, hc, ct, d, buf, ct, v, 0.f);
    lce_rows<T, I><<<static_cast<unsigned>(mm), kRowThreads, 0, ctx.stream>>>(
        p, buf, r0, bias, cw, t.target.data<I>(), rs, t.loss.data<float>(), t.zloss.data<float>(),
        t.lse.data<float>(), grads);
    KILN_CUDA_CHECK_LAUNCH("linear_cross_entropy rows");
    if (!grads) continue;
    if (t.grad_hidden.defined()) {
      // d_hidden rows [mm, d] = column-major [d, mm] = Wᵀ[d, V] · dzᵀ[V, mm].
      char* gh = static_cast<char*>(t.grad_hidden.data_ptr()) + r0 * d * itemsize(t.grad_hidden.dtype());
      lt_gemm(ctx, false, false, d, mm, v, W, ct, d, buf, ct, v, gh, cuda_type(t.grad_hidden.dtype()), d, 0.f);
    }
    if (t.grad_weight.defined()) {
      // d_weight [V, d] = column-major [d, V] += hcᵀ[d, mm] · dz[mm, V].
      lt_gemm(ctx, false, true, d, v, mm, hc, ct, d, buf, ct, v, t.grad_weight.data_ptr(),
              cuda_type(t.grad_weight.dtype()), d, 1.f);
    }
    if (t.grad_bias.defined()) {
      lce_bias_grad<T><<<static_cast<unsigned>((v + 255) / 256), 256, 0, ctx.stream>>>(buf, mm, v,
                                                                                        t.grad_bias.data<float>());
      KILN_CUDA_CHECK_LAUNCH("linear_cross_entropy bias grad");
    }
  }
}

}  // namespace

void linear_cross_entropy(const LceParams& p, const LceTensors& t) {
  if (p.n == 0) return;
  KILN_CHECK(!t.grad_bias.defined() || t.grad_bias.dtype() == DType::f32,
             "linear_cross_entropy: the CUDA bias gradient accumulates in f32");
  dispatch_index(t.target.dtype(), "linear_cross_entropy", [&]<class I>() {
    switch (t.hidden.dtype()) {
      case DType::f32: run<float, I>(p, t); break;
      case DType::bf16: run<__nv_bfloat16, I>(p, t); break;
      case DType::f16: run<__half, I>(p, t); break;
      default: fail("linear_cross_entropy: dtype ", dtype_name(t.hidden.dtype()),
                    " is not supported on CUDA (f32, bf16, f16)");
    }
  });
}

}  // namespace kiln::kernels::cuda
