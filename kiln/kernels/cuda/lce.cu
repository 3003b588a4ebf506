// CUDA body of the fused linear + cross-entropy (kiln/kernels/lce.h). Gradients are computed
// inside the forward, so the whole step costs three GEMMs, no logits recomputation:
//   per token chunk of m rows (chunk rule below):
//   1. logits[m, V] = h_c · Wᵀ           cuBLASLt, T in, f32 compute, T out (reused buffer whose
//                                         rows are padded to 16 bytes, so the row pass can use
//                                         16-byte loads)
//   2. row pass: online max/sum → lse; loss terms (smoothing, z-loss, softcap, class weights,
//      ignore); then dz written in place over the row, times the row's scale. One persistent
//      kernel: a block per SM taking rows in turn, each row read twice (the second read mostly
//      from L2). (A thread-block-cluster form reading each row once measured slower on the
//      H200 and was removed; BENCHMARKS.md.)
//   3. d_hidden[c] = dz · W               cuBLASLt, unsplit by default (cuBLASLt picks its own
//      split-K, reduced in its workspace); a manual dh_split S > 1 splits V into S slices (one
//      strided-batched call, f32 partials [S, m, d]) summed in slice order by a kernel
//   4. d_weight  += dzᵀ · h_c             cuBLASLt with beta = 1, in a fixed chunk order
//   5. d_bias    += column sums of dz     one thread per column, rows in order (f32)
// Chunk rule: the largest m (a multiple of 64, balanced over the chunks) whose buffers — logits
// m·Vp·sizeof(T), plus S·m·d·4 for a manual split — fit 256 MiB minus the per-token arrays:
// each chunk re-reads and re-writes all of d_weight (K = m in step 4), so fewer chunks mean less
// traffic. d_weight accumulation: by default in the weight's dtype (16-bit: one rounding per
// chunk of an f32-computed GEMM; see docs/loss.md for the error); LceTensors.grad_weight in f32
// gives exact-order f32 accumulation at V·d·4 bytes.
// Deterministic: no atomics; fixed reduction orders (block trees); the GEMMs' plans follow
// NOTE [cuBLASLt determinism rule] (cublaslt.h: no split-K reduction under determinism).
// Everything runs on the device's current stream (cuda::stream), the overlapped d_weight
// product on the registry's side stream.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/switches.h"
#include "kiln/core/stream.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/cublaslt.h"
#include "kiln/kernels/cuda/gemm/gemm.h"
#include "kiln/kernels/lce.h"

namespace kiln::kernels::cuda {
namespace {

constexpr int kRowThreads = 1024;
constexpr int64_t kExtraBytes = int64_t{256} << 20;  // everything the loss holds besides the gradients
constexpr int64_t kSlackBytes = int64_t{2} << 20;    // allocator rounding, scalars

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Elements of T in 16 bytes (one vector load of the row pass).
template <class T> constexpr int kVec = static_cast<int>(16 / sizeof(T));

template <class T>
__device__ __forceinline__ void load_vec(const T* p, float (&x)[kVec<T>]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) x[k] = to_f(e[k]);
}
template <class T>
__device__ __forceinline__ void store_vec(T* p, const float (&x)[kVec<T>]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) e[k] = from_f<T>(x[k]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// Merges two (max, sum of exp(x − max)) pairs.
__device__ __forceinline__ void merge_ms(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) { m = m2; s = s2; return; }
  if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; }
  else s += s2 * expf(m2 - m);
}

// Block-wide reduction of (max, sum) and a plain sum, in a fixed order (deterministic).
// Callable repeatedly by the same block (the leading barrier protects the shared slots).
__device__ void block_reduce(float& m, float& s, float& w) {
  __shared__ float sm[32], ss[32], sw[32];
  __syncthreads();
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

// A row's target: ignored, or out of range (the range check is deferred to the host's next
// synchronisation, ops/index_check.h): then nothing is read, the loss is NaN, the gradient 0.
struct RowTarget {
  int64_t t;
  bool ignored, bad;
};
template <class I>
__device__ __forceinline__ RowTarget row_target(const LceParams& p, const I* tgt, int64_t r) {
  RowTarget rt;
  rt.t = static_cast<int64_t>(tgt[r]);
  rt.ignored = rt.t == p.ignore_index;
  rt.bad = !rt.ignored && (rt.t < 0 || rt.t >= p.v);
  return rt;
}
// The factor of row r's gradient: p.grad_scale × the device scalar (mean's 1/divisor, grad_output)
// × the row's own scale (reduction none).
__device__ __forceinline__ float row_grad_scale(const LceParams& p, const double* gscale, const float* row_scale,
                                                int64_t r) {
  return static_cast<float>(p.grad_scale * (gscale ? *gscale : 1.0)) * (row_scale ? row_scale[r] : 1.f);
}

// The row pass over `rows` logits rows (row i at logits + i·ld, 16-byte aligned; global token
// r0 + i). Persistent: block b takes rows b, b + gridDim.x, ... so that about one row per SM is
// in flight and its second read tends to hit L2. Each thread reads 16-byte vectors; the
// elements past the last full vector are read one by one.
template <class T, class I>
__global__ void __launch_bounds__(kRowThreads) lce_rows(LceParams p, T* __restrict__ logits, int64_t ld, int64_t rows,
                                                      int64_t r0, const T* __restrict__ bias, const T* __restrict__ cw,
                                                      const I* __restrict__ tgt, const float* __restrict__ row_scale,
                                                      const double* __restrict__ gscale, float* __restrict__ loss, float* __restrict__ zloss,
                                                      float* __restrict__ lse_out, bool grads,
                                                      const float* __restrict__ stats, int64_t tiles,
                                                      unsigned char* __restrict__ nz, int64_t nz_ld) {
  constexpr int NV = kVec<T>;
  const int64_t v = p.v, nvec = v / NV;
  const float cap = static_cast<float>(p.softcap);
  const bool smooth = p.label_smoothing != 0.0;
  const float filter = static_cast<float>(p.filter_eps);
  auto adjust = [&](float x, int64_t j) {
    if (bias) x += to_f(bias[j]);
    return lce_cap(x, cap);
  };
  auto cweight = [&](int64_t j) { return cw ? to_f(cw[j]) : 1.f; };
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    T* z = logits + i * ld;
    const int64_t r = r0 + i;
    // Pass 1: online max and sum of exp; one rescale per vector, one exp per element. With the
    // logits GEMM's per-tile log-sum-exps (stats: no bias, no cap, no smoothing), their merge.
    float m = -INFINITY, s = 0.f, wz = 0.f;
    if (stats) {
      const float* st = stats + i * tiles;
      for (int64_t q = threadIdx.x; q < tiles; q += blockDim.x) merge_ms(m, s, st[q], 1.f);
    }
#pragma unroll 4
    for (int64_t q = stats ? nvec : threadIdx.x; q < nvec; q += blockDim.x) {
      float x[NV];
      load_vec<T>(z + q * NV, x);
      float mx = -INFINITY;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        x[k] = adjust(x[k], q * NV + k);
        mx = fmaxf(mx, x[k]);
        if (smooth) wz += cweight(q * NV + k) * x[k];
      }
      if (mx > m) {
        s = m == -INFINITY ? 0.f : s * expf(m - mx);
        m = mx;
      }
      if (m != -INFINITY) {
#pragma unroll
        for (int k = 0; k < NV; ++k) s += expf(x[k] - m);
      }
    }
    for (int64_t j = stats ? v : nvec * NV + threadIdx.x; j < v; j += blockDim.x) {
      const float x = adjust(to_f(z[j]), j);
      merge_ms(m, s, x, 1.f);
      if (smooth) wz += cweight(j) * x;
    }
    block_reduce(m, s, wz);
    const float lse = m + logf(s);
    const RowTarget tg = row_target(p, tgt, r);
    const int64_t t = tg.t;
    const bool ignored = tg.ignored;
    const float zt = ignored ? 0.f : tg.bad ? NAN : adjust(to_f(z[t]), t);
    const float wt = ignored || tg.bad ? 0.f : cweight(t);
    const LceRowTerms<float> rt = lce_row_terms<float>(p, lse, zt, wz, wt, ignored);
    if (threadIdx.x == 0) {
      loss[r] = rt.ce + rt.zl;
      zloss[r] = rt.zl;
      lse_out[r] = lse;
    }
    if (!grads) continue;
    // Every thread has read z[t] above before any thread overwrites the row below.
    __syncthreads();
    // Pass 2: dz in place.
    const float scale = row_grad_scale(p, gscale, row_scale, r);
    const bool zero = ignored || tg.bad || scale == 0.f;
    auto grad = [&](float x, int64_t j) {
      return rt.dz(expf(x - lse), cweight(j), j == t, filter) * lce_cap_deriv(x, cap) * scale;
    };
#pragma unroll 2
    for (int64_t q = threadIdx.x; q < nvec; q += blockDim.x) {
      float x[NV];
      if (zero) {
#pragma unroll
        for (int k = 0; k < NV; ++k) x[k] = 0.f;
      } else {
        load_vec<T>(z + q * NV, x);
#pragma unroll
        for (int k = 0; k < NV; ++k) x[k] = grad(adjust(x[k], q * NV + k), q * NV + k);
      }
      store_vec<T>(z + q * NV, x);
      if (nz && !zero) {  // the gradient filter's block flags: this 64 × 64 block has a nonzero
        bool any = false;
#pragma unroll
        for (int k = 0; k < NV; ++k) any |= x[k] != 0.f;
        if (any) nz[(i / 64) * nz_ld + q * NV / 64] = 1;
      }
    }
    for (int64_t j = nvec * NV + threadIdx.x; j < v; j += blockDim.x) {
      const float g = zero ? 0.f : grad(adjust(to_f(z[j]), j), j);
      z[j] = from_f<T>(g);
      if (nz && g != 0.f) nz[(i / 64) * nz_ld + j / 64] = 1;
    }
  }
}

// gb[j] += Σ_i g[i, j] over the chunk's rows (row i at g + i·ld), in row order.
template <class T>
__global__ void lce_bias_grad(const T* __restrict__ g, int64_t m, int64_t v, int64_t ld, float* __restrict__ gb) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= v) return;
  float acc = gb[j];
  for (int64_t i = 0; i < m; ++i) acc += to_f(g[i * ld + j]);
  gb[j] = acc;
}

// out[k] = Σ_s part[s·count + k] in slice order (the split d_hidden product's reduction).
template <class O>
__global__ void lce_dh_reduce(const float* __restrict__ part, int64_t splits, int64_t count, O* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < count; k += stride) {
    float acc = part[k];
    for (int64_t s = 1; s < splits; ++s) acc += part[s * count + k];
    out[k] = from_f<O>(acc);
  }
}

cudaDataType_t cuda_type(DType t) {
  KILN_CHECK(t == DType::f32 || t == DType::bf16 || t == DType::f16, "linear_cross_entropy: dtype ", dtype_name(t),
             " is not supported on CUDA (f32, bf16, f16)");
  return lt::cuda_type(t, "linear_cross_entropy");
}

using lt::alignment_of;
// One product in cuBLASLt's column-major terms (f32 compute), planned once per shape by the
// planner (cublaslt.h) and run per chunk with the chunk's pointers.
using GemmShape = lt::PlanKey;
using LtGemm = lt::Plan;

const LtGemm* make_gemm(DeviceContext& ctx, const GemmShape& s) { return &lt::plan(ctx, s, "linear_cross_entropy"); }

void run_gemm(DeviceContext& ctx, const LtGemm& g, const void* A, const void* B, void* C, float beta,
              cudaStream_t stream = nullptr) {
  lt::run_f32(ctx, g, 1.f, A, B, beta, C, "linear_cross_entropy", stream);
}

// The d_weight product's side stream (LceParams::dw_sms): the device's registry side stream
// (kiln/core/stream.h), forked from and joined into the current stream `main` by events made
// per call; joined when it goes out of scope (declared after the chunk buffer, so before the
// buffer returns to the caching allocator, which tracks the current stream only).
class SideStream {
 public:
  SideStream(bool on, int device, cudaStream_t main) : main_(main) {
    if (!on) return;
    stream_ = static_cast<cudaStream_t>(get_stream(kiln::cuda(device), StreamKind::side).native());
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    if (stream_ && cudaEventRecord(done_, stream_) == cudaSuccess) cudaStreamWaitEvent(main_, done_, 0);
    if (done_) cudaEventDestroy(done_);
    if (ready_) cudaEventDestroy(ready_);
  }
  cudaStream_t get() const { return stream_; }
  // The side stream waits for everything queued on `main` so far.
  void fork(cudaStream_t main) {
    KILN_CUDA_CHECK(cudaEventRecord(ready_, main));
    KILN_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
  }
  // `main` waits for everything queued on the side stream so far.
  void join(cudaStream_t main) {
    KILN_CUDA_CHECK(cudaEventRecord(done_, stream_));
    KILN_CUDA_CHECK(cudaStreamWaitEvent(main, done_, 0));
  }

 private:
  cudaStream_t main_ = nullptr, stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

// Slice length of V when the d_hidden product is split s ways: a multiple of 8 elements (16-byte
// aligned batch offsets); the remainder v − s·slice goes into the last partial.
int64_t slice_len(int64_t v, int64_t s) { return s > 1 ? (v / s) / 8 * 8 : v; }

// The d_hidden product of an mm-token chunk split s ways (s = 1: straight into d_hidden).
// align_c and the batch strides assume the partials start 256-byte aligned (the allocator's).
GemmShape dh_shape(int64_t d, int64_t mm, int64_t v, int64_t ld, int64_t s, cudaDataType_t ct, cudaDataType_t gh_t,
                   const void* W, int64_t es) {
  GemmShape g;
  g.m = d, g.n = mm, g.at = g.bt = ct;
  g.lda = d, g.ldb = ld, g.ldc = d;
  if (s == 1) {
    g.k = v, g.ct = gh_t;
    g.align_a = alignment_of(W);
    return g;
  }
  const int64_t vs = slice_len(v, s);
  g.k = vs, g.ct = CUDA_R_32F;
  g.batch = s, g.stride_a = vs * d, g.stride_b = vs, g.stride_c = mm * d;
  g.align_a = alignment_of(W, vs * d * es), g.align_b = alignment_of(nullptr, vs * es);
  g.align_c = alignment_of(nullptr, mm * d * 4);
  return g;
}

struct Chunking {
  int64_t m = 1;       // tokens per chunk
  int64_t splits = 1;  // slices of the d_hidden product
  int64_t ld = 1;      // leading dimension of the logits buffer (V rounded up to 16 bytes)
};

// The chunk rule (docs/loss.md): m = the largest multiple of 64 tokens whose logits buffer (and,
// with a manual dh_split s > 1, the s f32 partials) fit the budget, balanced over the chunks.
// The d_hidden product is unsplit by default (s = 1): cuBLASLt then picks its own split-K for the
// long K = V, with its reduction in the workspace (make_gemm keeps the schemes deterministic), and
// the chunk is as large as the budget allows. Measured on the H200 (bf16, fwd+bwd) this beat the
// former modelled choice of s: 85.4 vs 87.2 ms (N=16384, d=4096, V=128256) and 57.4 vs 63.3 ms
// (N=8192, d=2304, V=256000). dh_split > 0 fixes s; chunk_tokens > 0 fixes m.
// row_bytes: what each token of a chunk holds besides its logits row (the logits GEMM's per-tile
// log-sum-exps on kiln's GEMM).
Chunking choose_chunking(const LceParams& p, int64_t es, bool want_dh, size_t workspace_bytes, int64_t row_bytes) {
  Chunking c;
  const int64_t n = p.n, d = p.d, v = p.v, vec = 16 / es;
  c.ld = ceil_div(v, vec) * vec;
  c.splits = want_dh && p.dh_split > 1 && slice_len(v, p.dh_split) > 0 ? p.dh_split : 1;
  if (p.chunk_tokens > 0) {
    c.m = std::min(p.chunk_tokens, n);
    return c;
  }
  // What the loss allocates (kiln's allocator, what peak_bytes measures), plus the cuBLASLt
  // workspace its GEMMs use. That workspace is the device context's (allocated once for every
  // GEMM of the process, outside kiln's allocator statistics), but it is charged here all the
  // same, so that the loss stays within the budget even counting it (docs/loss.md).
  const int64_t budget = std::max<int64_t>(
      kExtraBytes - kSlackBytes - static_cast<int64_t>(workspace_bytes) - 16 * n,  // loss, zloss, lse, row_scale
      c.ld * es);
  int64_t m = std::max<int64_t>(budget / (c.ld * es + row_bytes + (c.splits > 1 ? c.splits * d * 4 : 0)), 1);
  if (m >= 64) {
    m -= m % 64;
    const int64_t chunks = ceil_div(n, m);
    m = std::min(m, ceil_div(ceil_div(n, chunks), 64) * 64);
  }
  c.m = std::min(m, n);
  return c;
}

// Marks phase boundaries with CUDA events on the stream; finish() waits and adds each
// phase's time to the accumulator given at its closing mark. Off: does nothing.
class PhaseTimer {
 public:
  PhaseTimer(cudaStream_t s, bool on) : stream_(s), on_(on) { mark(nullptr); }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;
  ~PhaseTimer() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void mark(double* acc) {
    if (!on_) return;
    cudaEvent_t e = nullptr;
    KILN_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
    accs_.push_back(acc);
    KILN_CUDA_CHECK(cudaEventRecord(e, stream_));
  }
  void finish() {
    if (!on_ || events_.size() < 2) return;
    KILN_CUDA_CHECK(cudaEventSynchronize(events_.back()));
    for (size_t k = 1; k < events_.size(); ++k) {
      if (!accs_[k]) continue;
      float ms = 0;
      KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[k - 1], events_[k]));
      *accs_[k] += ms;
    }
  }

 private:
  cudaStream_t stream_;
  bool on_;
  std::vector<cudaEvent_t> events_;
  std::vector<double*> accs_;
};

template <class O>
void launch_dh_reduce(const DeviceContext& ctx, const float* part, int64_t splits, int64_t count, void* out) {
  const int64_t blocks = std::min<int64_t>(ceil_div(count, 256), int64_t{8} * std::max(ctx.sm_count, 1));
  lce_dh_reduce<O><<<static_cast<unsigned>(blocks), 256, 0, stream(ctx.device)>>>(part, splits, count, static_cast<O*>(out));
  KILN_CUDA_CHECK_LAUNCH("linear_cross_entropy d_hidden reduction");
}

namespace kg = ::kiln::kernels::gemm;

// Rows [first, first + count) of a row-major matrix of `cols` columns, `ld` apart, over t's storage.
Tensor rows_view(const Tensor& t, int64_t cols, int64_t ld, int64_t first, int64_t count) {
  return Tensor::from_storage(t.storage(), {count, cols}, {ld, 1}, t.offset() + first * ld, t.dtype());
}

// One product of a chunk on kiln's GEMM (LceParams::gemm_backend == kiln) where kiln_supported
// says it applies: true when it ran; false (nothing done) sends the caller to cuBLASLt's plan.
// KILN_GEMM_VERBOSE=1 says why kiln's kernel did not apply.
bool kiln_product(const kg::GemmProblem& pr, const kg::EpilogueArgs& e, const char* what) {
  std::string why;
  if (!kg::kiln_supported(pr, e, &why)) {
    if (std::getenv("KILN_GEMM_VERBOSE")) std::fprintf(stderr, "kiln: linear_cross_entropy %s: cuBLASLt: %s\n", what, why.c_str());
    return false;
  }
  kg::GemmOptions o;
  o.backend = kg::Backend::kiln;
  kg::gemm(pr, e, o);
  return true;
}

std::string kiln_algo(kg::Epilogue e) { return std::string("kiln sm90 ") + kg::epilogue_name(e); }

// The products of one chunk size (the full chunks and, when N is not a multiple, the last).
struct ChunkPlans {
  const LtGemm* logits = nullptr;
  const LtGemm* dh = nullptr;
  const LtGemm* dh_tail = nullptr;
  const LtGemm* dw = nullptr;
};

template <class T, class I>
void run(const LceParams& p, const LceTensors& t) {
  const int dev = t.hidden.device().index;
  DeviceContext& ctx = context(dev);
  const cudaStream_t cs = stream(dev);
  const DType dt = t.hidden.dtype();
  const cudaDataType_t ct = cuda_type(dt);
  const int64_t n = p.n, d = p.d, v = p.v, es = static_cast<int64_t>(itemsize(dt));
  const bool grads = t.grad_hidden.defined() || t.grad_weight.defined() || t.grad_bias.defined();
  const T* W = static_cast<const T*>(t.weight.data_ptr());
  char* gh = t.grad_hidden.defined() ? static_cast<char*>(t.grad_hidden.data_ptr()) : nullptr;
  const int64_t gh_es = t.grad_hidden.defined() ? static_cast<int64_t>(itemsize(t.grad_hidden.dtype())) : 0;
  const cudaDataType_t gh_t = t.grad_hidden.defined() ? cuda_type(t.grad_hidden.dtype()) : ct;
  void* gw = t.grad_weight.defined() ? t.grad_weight.data_ptr() : nullptr;
  const cudaDataType_t gw_t = t.grad_weight.defined() ? cuda_type(t.grad_weight.dtype()) : ct;
  // kiln's GEMM for the products (16-bit inputs); the logits' log-sum-exp from its epilogue where
  // the row pass needs nothing else of pass 1 (no bias, cap or smoothing).
  const bool kiln_gemm = p.gemm_backend == kg::Backend::kiln && dt != DType::f32;
  const bool lse_epi = kiln_gemm && !t.bias.defined() && p.softcap == 0.0 && p.label_smoothing == 0.0;
  const int64_t tiles = kg::row_stat_tiles(v);
  // d_weight on a side stream, concurrent with d_hidden, each held to part of the SMs (opt-in;
  // not while profiling, whose events time one stream).
  const bool overlap = p.dw_sms > 0 && p.dw_sms < ctx.sm_count && gw && gh && grads && !p.profile;
  // (not with the side stream, whose products stay on cuBLASLt)
  const bool filter_blocks = kiln_gemm && grads && p.filter_eps > 0.0 && !overlap;
  const int64_t nz_ld = kg::sparse_blocks(v);
  const Chunking ck = choose_chunking(p, es, grads && gh != nullptr, ctx.workspace_bytes,
                                      (lse_epi ? tiles * 4 : 0) + (filter_blocks ? nz_ld / 64 + 1 : 0));
  const int64_t m = ck.m, S = ck.splits, ld = ck.ld;
  const int64_t vs = slice_len(v, S);  // slice length of the split d_hidden product
  const int64_t vtail = v - S * vs;    // the rest, added into the last partial

  Tensor buf_t = Tensor::empty({m, ld}, dt, t.hidden.device());
  T* buf = static_cast<T*>(buf_t.data_ptr());
  KILN_CHECK(reinterpret_cast<uintptr_t>(buf) % 16 == 0, "linear_cross_entropy: logits buffer not 16-byte aligned");
  Tensor part_t;
  float* part = nullptr;
  if (S > 1) {
    part_t = Tensor::empty({S, m, d}, DType::f32, t.hidden.device());
    part = part_t.data<float>();
  }
  Tensor stats_t;  // the logits GEMM's per-tile log-sum-exps, f32 [m, tiles]
  if (lse_epi) stats_t = Tensor::empty({m, tiles}, DType::f32, t.hidden.device());
  // The gradient filter on kiln's GEMM: flags of dz's 64 × 64 blocks (u8 [m/64, V/64], 0: all
  // zero), set by the row pass, so that the d_hidden and d_weight products skip the zero blocks.
  Tensor nz_t;
  if (filter_blocks) nz_t = Tensor::empty({kg::sparse_blocks(m), nz_ld}, DType::u8, t.hidden.device());
  const T* H = static_cast<const T*>(t.hidden.data_ptr());
  const T* bias = t.bias.defined() ? static_cast<const T*>(t.bias.data_ptr()) : nullptr;
  const T* cw = t.class_weight.defined() ? static_cast<const T*>(t.class_weight.data_ptr()) : nullptr;
  const float* rs = t.row_scale.defined() ? t.row_scale.data<float>() : nullptr;

  const int32_t dh_sms = overlap ? static_cast<int32_t>(ctx.sm_count - p.dw_sms) : 0;
  auto plan = [&](int64_t mm) {
    ChunkPlans pl;
    GemmShape g;
    // logits row-major [mm, V] (ld) = column-major [V, mm] = W(T) · hcᵀ.
    g = {};
    g.ta = true;
    g.m = v, g.n = mm, g.k = d;
    g.at = g.bt = g.ct = ct;
    g.lda = d, g.ldb = d, g.ldc = ld;
    g.align_a = alignment_of(W), g.align_b = alignment_of(H, m * d * es), g.align_c = alignment_of(buf);
    pl.logits = make_gemm(ctx, g);
    if (!grads) return pl;
    if (gh && S == 1) {
      // d_hidden rows [mm, d] = column-major [d, mm] = Wᵀ[d, V] · dzᵀ[V, mm].
      g = dh_shape(d, mm, v, ld, 1, ct, gh_t, W, es);
      g.align_b = alignment_of(buf), g.align_c = alignment_of(gh, m * d * gh_es);
      g.sm_target = dh_sms;
      pl.dh = make_gemm(ctx, g);
    } else if (gh) {
      // Partial s [d, mm] (f32) = W[s·vs : (s+1)·vs]ᵀ · dz[:, s·vs : (s+1)·vs]ᵀ, one batched call.
      g = dh_shape(d, mm, v, ld, S, ct, gh_t, W, es);
      g.align_b = alignment_of(buf, vs * es), g.align_c = alignment_of(part, mm * d * 4);
      g.sm_target = dh_sms;
      pl.dh = make_gemm(ctx, g);
      if (vtail > 0) {
        GemmShape tg = g;
        tg.k = vtail;
        tg.batch = 1, tg.stride_a = tg.stride_b = tg.stride_c = 0;
        tg.align_a = alignment_of(W + S * vs * d), tg.align_b = alignment_of(buf + S * vs);
        tg.align_c = alignment_of(part + (S - 1) * mm * d);
        tg.sm_target = dh_sms;
        pl.dh_tail = make_gemm(ctx, tg);
      }
    }
    if (gw) {
      // d_weight [V, d] = column-major [d, V] += hcᵀ[d, mm] · dz[mm, V].
      g = {};
      g.tb = true;
      g.m = d, g.n = v, g.k = mm;
      g.at = g.bt = ct, g.ct = gw_t;
      g.lda = d, g.ldb = ld, g.ldc = d;
      g.align_a = alignment_of(H, m * d * es), g.align_b = alignment_of(buf), g.align_c = alignment_of(gw);
      if (overlap) g.sm_target = static_cast<int32_t>(p.dw_sms), g.no_workspace = true;
      pl.dw = make_gemm(ctx, g);
    }
    return pl;
  };
  ChunkPlans full = plan(m), last;
  if (n % m != 0) last = plan(n % m);

  LceProfile* prof = p.profile;
  auto acc = [&](double LceProfile::*f) { return prof ? &(prof->*f) : nullptr; };
  PhaseTimer timer(cs, prof != nullptr);
  const int row_blocks = std::max(ctx.sm_count, 1);
  const double* gscale = t.grad_scale.defined() ? t.grad_scale.data<double>() : nullptr;
  SideStream side(overlap, dev, cs);
  bool logits_kiln_full = false, dh_kiln_full = false;  // for the profile: the full chunks' products on kiln
  std::optional<kg::Epilogue> dw_kiln_full;
  for (int64_t r0 = 0; r0 < n; r0 += m) {
    const int64_t mm = std::min(m, n - r0);
    const ChunkPlans& pl = mm == m ? full : last;
    const T* hc = H + r0 * d;
    if (overlap && r0 > 0) side.join(cs);  // the previous d_weight product has read the buffer
    // The chunk's operands as tensors, for kiln's GEMM: hc [mm, d], the logits / dz [mm, V] (row
    // stride ld), W [V, d].
    Tensor hc_t, z_t;
    if (kiln_gemm) {
      hc_t = rows_view(t.hidden, d, d, r0, mm);
      z_t = rows_view(buf_t, v, ld, 0, mm);
    }
    kg::EpilogueArgs le;
    if (lse_epi) {
      le.kind = kg::Epilogue::row_lse;
      le.lse_of_stored = true;  // the lse of the logits the row pass reads (bf16 / f16), not of v
      le.row_stats = Tensor::from_storage(stats_t.storage(), {1, mm, tiles}, {mm * tiles, tiles, 1}, 0, DType::f32);
    }
    const bool kiln_logits = kiln_gemm && kiln_product({hc_t, t.weight, z_t, false, true}, le, "logits");
    if (!kiln_logits) run_gemm(ctx, *pl.logits, W, hc, buf, 0.f);
    if (mm == m) logits_kiln_full = kiln_logits;
    const float* stats = kiln_logits && lse_epi ? stats_t.data<float>() : nullptr;
    unsigned char* nz = nullptr;
    if (nz_t.defined()) {
      nz = static_cast<unsigned char*>(nz_t.data_ptr());
      KILN_CUDA_CHECK(cudaMemsetAsync(nz, 0, static_cast<size_t>(nz_t.numel()), cs));
    }
    // dz's block flags as the a_nonzero of d_hidden (a = dz) and of d_weight (a = dzᵀ).
    auto flags = [&](bool transposed) {
      if (!nz) return Tensor();
      const int64_t tb = kg::sparse_blocks(mm);
      return transposed ? Tensor::from_storage(nz_t.storage(), {nz_ld, tb}, {1, nz_ld}, 0, DType::u8)
                        : Tensor::from_storage(nz_t.storage(), {tb, nz_ld}, {nz_ld, 1}, 0, DType::u8);
    };
    timer.mark(acc(&LceProfile::logits_ms));
    lce_rows<T, I><<<static_cast<unsigned>(std::min<int64_t>(mm, row_blocks)), kRowThreads, 0, cs>>>(
        p, buf, ld, mm, r0, bias, cw, t.target.data<I>(), rs, gscale, t.loss.data<float>(), t.zloss.data<float>(),
        t.lse.data<float>(), grads, stats, tiles, nz, nz_ld);
    KILN_CUDA_CHECK_LAUNCH("linear_cross_entropy rows");
    timer.mark(acc(&LceProfile::rows_ms));
    if (prof && nz) {  // the skipped blocks' count (a measurement aid: waits for the row pass)
      std::vector<unsigned char> f(static_cast<size_t>(kg::sparse_blocks(mm) * nz_ld));
      KILN_CUDA_CHECK(cudaMemcpyAsync(f.data(), nz, f.size(), cudaMemcpyDeviceToHost, cs));
      KILN_CUDA_CHECK(cudaStreamSynchronize(cs));
      prof->sparse_blocks += static_cast<int64_t>(f.size());
      prof->sparse_zero_blocks += std::count(f.begin(), f.end(), static_cast<unsigned char>(0));
      timer.mark(nullptr);  // the wait counts in no phase
    }
    if (!grads) continue;
    if (overlap) {  // d_weight (the chunk order is kept: one side stream) while d_hidden runs here
      side.fork(cs);
      run_gemm(ctx, *pl.dw, hc, buf, gw, 1.f, side.get());
    }
    if (gh) {
      char* ghc = gh + r0 * d * gh_es;
      if (S == 1) {
        // d_hidden [mm, d] = dz [mm, V] · W [V, d] (kiln: out in the inputs' dtype only).
        const bool kiln_dh = kiln_gemm && !overlap && t.grad_hidden.dtype() == dt &&
                             kiln_product({z_t, t.weight, rows_view(t.grad_hidden, d, d, r0, mm), false, false, flags(false)},
                                          {}, "d_hidden");
        if (!kiln_dh) run_gemm(ctx, *pl.dh, W, buf, ghc, 0.f);
        if (mm == m) dh_kiln_full = kiln_dh;
        timer.mark(acc(&LceProfile::dh_ms));
      } else {
        run_gemm(ctx, *pl.dh, W, buf, part, 0.f);
        if (pl.dh_tail) run_gemm(ctx, *pl.dh_tail, W + S * vs * d, buf + S * vs, part + (S - 1) * mm * d, 1.f);
        timer.mark(acc(&LceProfile::dh_ms));
        switch (t.grad_hidden.dtype()) {
          case DType::f32: launch_dh_reduce<float>(ctx, part, S, mm * d, ghc); break;
          case DType::bf16: launch_dh_reduce<__nv_bfloat16>(ctx, part, S, mm * d, ghc); break;
          case DType::f16: launch_dh_reduce<__half>(ctx, part, S, mm * d, ghc); break;
          default: fail("linear_cross_entropy: grad_hidden dtype ", dtype_name(t.grad_hidden.dtype()));
        }
        timer.mark(acc(&LceProfile::dh_reduce_ms));
      }
    }
    if (gw && !overlap) {
      // d_weight [V, d] += dzᵀ · hc: kiln's accumulate epilogue into an f32 gradient, its residual
      // epilogue over the gradient itself (out = v + out) into a 16-bit one.
      bool kiln_dw = false;
      if (kiln_gemm) {
        kg::EpilogueArgs we;
        const Tensor gw_t = rows_view(t.grad_weight, d, d, 0, v);
        we.kind = t.grad_weight.dtype() == DType::f32 ? kg::Epilogue::accumulate : kg::Epilogue::residual;
        if (we.kind == kg::Epilogue::residual) we.residual = gw_t;
        kiln_dw = kiln_product({z_t, hc_t, gw_t, true, false, flags(true)}, we, "d_weight");
        if (mm == m && kiln_dw) dw_kiln_full = we.kind;
      }
      if (!kiln_dw) run_gemm(ctx, *pl.dw, hc, buf, gw, 1.f);
      timer.mark(acc(&LceProfile::dw_ms));
    }
    if (t.grad_bias.defined()) {
      lce_bias_grad<T><<<static_cast<unsigned>((v + 255) / 256), 256, 0, cs>>>(buf, mm, v, ld,
                                                                                        t.grad_bias.data<float>());
      KILN_CUDA_CHECK_LAUNCH("linear_cross_entropy bias grad");
      timer.mark(acc(&LceProfile::bias_ms));
    }
  }
  timer.finish();
  if (prof) {
    prof->chunks += ceil_div(n, m);
    prof->chunk_tokens = m;
    prof->dh_split = S;
    prof->extra_bytes = m * ld * es + (S > 1 ? S * m * d * 4 : 0);
    prof->extra_bytes += (stats_t.defined() ? m * tiles * 4 : 0) + (nz_t.defined() ? nz_t.numel() : 0);
    prof->logits_algo = logits_kiln_full ? kiln_algo(lse_epi ? kg::Epilogue::row_lse : kg::Epilogue::none)
                                         : lt::describe(*full.logits);
    if (full.dh) prof->dh_algo = dh_kiln_full ? kiln_algo(kg::Epilogue::none) : lt::describe(*full.dh);
    if (full.dw) prof->dw_algo = dw_kiln_full ? kiln_algo(*dw_kiln_full) : lt::describe(*full.dw);
  }
}

// x[i] *= *s unless *s == 1 (then nothing is written).
template <class T>
__global__ void lce_scale_kernel(T* __restrict__ x, int64_t n, const float* __restrict__ s) {
  const float f = *s;
  if (f == 1.f) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += stride)
    x[k] = from_f<T>(to_f(x[k]) * f);
}

}  // namespace

void lce_scale(const Tensor& x, const Tensor& s) {
  KILN_CHECK(x.is_contiguous() && s.numel() == 1 && s.dtype() == DType::f32 && s.device() == x.device(),
             "linear_cross_entropy: lce_scale needs a contiguous tensor and an f32 scalar on its device");
  const int64_t n = x.numel();
  if (n == 0) return;
  DeviceContext& ctx = context(x.device().index);
  const cudaStream_t cs = stream(x.device().index);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), int64_t{8} * std::max(ctx.sm_count, 1)));
  const float* sp = s.data<float>();
  switch (x.dtype()) {
    case DType::f32: lce_scale_kernel<float><<<blocks, 256, 0, cs>>>(x.data<float>(), n, sp); break;
    case DType::bf16:
      lce_scale_kernel<__nv_bfloat16><<<blocks, 256, 0, cs>>>(static_cast<__nv_bfloat16*>(x.data_ptr()), n, sp);
      break;
    case DType::f16:
      lce_scale_kernel<__half><<<blocks, 256, 0, cs>>>(static_cast<__half*>(x.data_ptr()), n, sp);
      break;
    default: fail("linear_cross_entropy: gradient dtype ", dtype_name(x.dtype()), " is not supported on CUDA");
  }
  KILN_CUDA_CHECK_LAUNCH("linear_cross_entropy grad_output scale");
}

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
