// Bodies of gemm.h on CUDA: argument checks, the two backends and the selection between them.
// - kiln: the Hopper kernel (launch.h, sm90_gemm.cuh) with the epilogue fused.
// - cublaslt: the planner's product (cublaslt.h), with the epilogue fused where cuBLASLt has it
//   (none: alpha and the output type; bias: its BIAS epilogue; accumulate: beta = 1 into the f32
//   output), else into an f32 scratch product followed by epilogue_pass / row_pass, which run
//   the same RtEpilogue functor as the kiln kernel (epilogue.cuh).
// - auto: kiln where a one-time measurement of both on this problem chose it (median of 5 timed
//   runs after 2 warm-ups, on scratch outputs), remembered per process and on disk
//   (autotune_cache.h), keyed by the GPU's name, the driver's version and kiln's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <mutex>
#include <vector>

#include "kiln/core/allocator.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/cublaslt.h"
#include "kiln/kernels/cuda/gemm/autotune_cache.h"
#include "kiln/kernels/cuda/gemm/gemm.h"
#include "kiln/kernels/cuda/gemm/launch.h"
#include "kiln/kernels/cuda/gemm/select.h"
#include "kiln/kernels/matmul.h"
#include "kiln/kernels/timing.h"

namespace kiln::kernels::gemm {

namespace sm = ::kiln::kernels::cuda::gemm_sm90;
namespace lt = ::kiln::kernels::cuda::lt;
using ::kiln::kernels::cuda::DeviceContext;

namespace {

constexpr int64_t kMax32 = int64_t{1} << 31;

// The problem's sizes and strides, checked (an error for anything gemm.h does not allow).
struct Dims {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  // Row-major storage of each operand: a is [M, K] or [K, M] (trans_a); b [K, N] or [N, K].
  int64_t lda = 0, ldb = 0, ldo = 0, sa = 0, sb = 0, so = 0;
  int64_t out_cols = 0;
};

int64_t batch_stride(const Tensor& t) { return t.dim() == 3 ? (t.size(0) == 1 ? 0 : t.stride(0)) : 0; }
// A one-row operand's row stride is never stepped: any value ≥ its columns that TMA and cuBLASLt
// accept (a multiple of 8 elements) describes it.
int64_t row_stride(const Tensor& t) {
  return t.size(-2) == 1 ? (std::max<int64_t>(t.size(-1), 1) + 7) / 8 * 8 : t.stride(-2);
}

Dims check_problem(const GemmProblem& p, const EpilogueArgs& e) {
  const char* op = "gemm";
  KILN_CHECK(p.a.defined() && p.b.defined() && p.out.defined(), op, ": a, b and out must be defined");
  for (const Tensor* t : {&p.a, &p.b, &p.out}) {
    KILN_CHECK(t->dim() == 2 || t->dim() == 3, op, ": operands are 2-D or 3-D (got ", t->dim(), "-D)");
    KILN_CHECK(t->size(-1) <= 1 || t->stride(-1) == 1, op, ": the last dim of every operand must be contiguous");
    KILN_CHECK(t->is_cuda() && t->device() == p.out.device(), op, ": operands must be on one CUDA device (got ",
               t->device().str(), " and ", p.out.device().str(), ")");
  }
  KILN_CHECK(p.a.dtype() == p.b.dtype() && (p.a.dtype() == DType::bf16 || p.a.dtype() == DType::f16), op,
             ": a and b must both be bf16 or both f16 (got ", dtype_name(p.a.dtype()), " and ", dtype_name(p.b.dtype()),
             ")");
  KILN_CHECK(p.out.dtype() == p.a.dtype() || p.out.dtype() == DType::f32, op, ": out must be ",
             dtype_name(p.a.dtype()), " or f32 (got ", dtype_name(p.out.dtype()), ")");
  Dims d;
  d.batch = p.out.dim() == 3 ? p.out.size(0) : 1;
  for (const Tensor* t : {&p.a, &p.b})
    KILN_CHECK(t->dim() == 2 || t->size(0) == d.batch || t->size(0) == 1, op, ": batch ", t->size(0),
               " of an operand does not match out's ", d.batch);
  d.m = p.trans_a ? p.a.size(-1) : p.a.size(-2);
  d.k = p.trans_a ? p.a.size(-2) : p.a.size(-1);
  const int64_t kb = p.trans_b ? p.b.size(-1) : p.b.size(-2);
  d.n = p.trans_b ? p.b.size(-2) : p.b.size(-1);
  KILN_CHECK(kb == d.k, op, ": inner dims differ (a gives K=", d.k, ", b gives ", kb, ")");
  d.out_cols = e.kind == Epilogue::swiglu ? d.n / 2 : d.n;
  KILN_CHECK(e.kind != Epilogue::swiglu || d.n % 2 == 0, op, ": swiglu needs an even N (gate and up interleaved), got ",
             d.n);
  KILN_CHECK(p.out.size(-2) == d.m && p.out.size(-1) == d.out_cols, op, ": out is [", p.out.size(-2), ", ",
             p.out.size(-1), "], expected [", d.m, ", ", d.out_cols, "]");
  KILN_CHECK(e.kind != Epilogue::accumulate || p.out.dtype() == DType::f32, op, ": accumulate needs an f32 out");
  if (e.kind == Epilogue::bias) {
    KILN_CHECK(e.bias.defined() && e.bias.dim() == 1 && e.bias.size(0) == d.n && e.bias.is_contiguous() &&
                   e.bias.dtype() == p.out.dtype() && e.bias.device() == p.out.device(),
               op, ": bias must be a contiguous [", d.n, "] ", dtype_name(p.out.dtype()), " tensor on out's device");
  }
  if (e.kind == Epilogue::residual) {
    const Tensor& r = e.residual;
    KILN_CHECK(r.defined() && r.shape() == p.out.shape() && r.dtype() == p.out.dtype() && r.device() == p.out.device() &&
                   (r.size(-1) <= 1 || r.stride(-1) == 1),
               op, ": residual must have out's shape, dtype and device and a contiguous last dim");
  }
  if (e.kind == Epilogue::row_lse || e.kind == Epilogue::row_sumsq) {
    const Tensor& s = e.row_stats;
    KILN_CHECK(s.defined() && s.dtype() == DType::f32 && s.is_contiguous() && s.device() == p.out.device() &&
                   s.numel() == d.batch * d.m * row_stat_tiles(d.n),
               op, ": row_stats must be a contiguous f32 [", d.batch, ", ", d.m, ", ", row_stat_tiles(d.n), "] tensor");
  }
  if (p.a_nonzero.defined()) {
    const Tensor& z = p.a_nonzero;
    KILN_CHECK(z.dtype() == DType::u8 && z.dim() == 2 && z.size(0) == sparse_blocks(d.m) &&
                   z.size(1) == sparse_blocks(d.k) && z.device() == p.out.device(),
               op, ": a_nonzero must be a u8 [", sparse_blocks(d.m), ", ", sparse_blocks(d.k), "] tensor on out's device");
    KILN_CHECK(d.batch == 1, op, ": a_nonzero needs batch 1 (got ", d.batch, ")");
  }
  d.lda = row_stride(p.a), d.ldb = row_stride(p.b), d.ldo = row_stride(p.out);
  d.sa = batch_stride(p.a), d.sb = batch_stride(p.b), d.so = batch_stride(p.out);
  KILN_CHECK(d.batch == 1 || d.so != 0, op, ": out must not be broadcast over the batch");
  return d;
}

sm::EpiParams epi_params(const GemmProblem& p, const EpilogueArgs& e, const Dims& d) {
  sm::EpiParams ep{};
  ep.kind = static_cast<int>(e.kind);
  ep.out_f32 = p.out.dtype() == DType::f32;
  ep.out = p.out.data_ptr();
  ep.ldo = d.ldo, ep.out_bstride = d.so;
  ep.pair_stores = reinterpret_cast<uintptr_t>(ep.out) % 8 == 0 && d.ldo % 2 == 0 && d.so % 2 == 0;
  ep.bias = e.kind == Epilogue::bias ? e.bias.data_ptr() : nullptr;
  const uintptr_t pair_bytes = ep.out_f32 ? 8 : 4;
  ep.pair_bias = ep.bias != nullptr && reinterpret_cast<uintptr_t>(ep.bias) % pair_bytes == 0;
  if (e.kind == Epilogue::residual) {
    ep.res = e.residual.data_ptr();
    ep.ldr = row_stride(e.residual), ep.res_bstride = batch_stride(e.residual);
    ep.pair_res = reinterpret_cast<uintptr_t>(ep.res) % pair_bytes == 0 && ep.ldr % 2 == 0 && ep.res_bstride % 2 == 0;
  }
  ep.alpha = e.alpha;
  if (e.kind == Epilogue::row_lse || e.kind == Epilogue::row_sumsq) {
    ep.stats = e.row_stats.data<float>();
    ep.stats_ld = row_stat_tiles(d.n), ep.stats_bstride = d.m * row_stat_tiles(d.n);
    ep.lse_stored = e.lse_of_stored ? 1 : 0;
  }
  return ep;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool supported(const GemmProblem& p, const Dims& d, std::string* why) {
  auto no = [&](const std::string& w) {
    if (why) *why = w;
    return false;
  };
  const DeviceContext& ctx = ::kiln::kernels::cuda::context(p.out.device().index);
  int major = 0;
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx.device));
  if (major != 9) return no("kiln's GEMM kernel needs an sm_90 (Hopper) GPU; this one is sm_" + std::to_string(major) + "x");
  if (d.m >= kMax32 || d.n >= kMax32 || d.k >= kMax32 || d.batch >= kMax32)
    return no("a size is 2^31 or more");
  const int64_t tiles = d.batch * ((d.m + 127) / 128) * ((d.n + 127) / 128);
  if (tiles >= kMax32) return no("more than 2^31 tiles");
  if (!aligned16(p.a.data_ptr()) || !aligned16(p.b.data_ptr()))
    return no("the a and b base addresses must be 16-byte aligned (TMA)");
  if (d.lda % 8 != 0 || d.ldb % 8 != 0) return no("the rows of a and b must be a multiple of 16 bytes apart (TMA)");
  if (d.sa % 8 != 0 || d.sb % 8 != 0) return no("the batch strides of a and b must be multiples of 16 bytes (TMA)");
  return true;
}

sm::Launch make_launch(const GemmProblem& p, const EpilogueArgs& e, const Dims& d, const GemmOptions& o) {
  const DeviceContext& ctx = ::kiln::kernels::cuda::context(p.out.device().index);
  sm::Launch l;
  l.device = ctx.device;
  l.stream = ::kiln::kernels::cuda::stream(ctx.device);
  l.sm_count = std::max(ctx.sm_count, 1);
  l.tile_n = o.tile_n;
  l.direct_store = o.direct_store;
  l.m = d.m, l.n = d.n, l.k = d.k, l.batch = d.batch;
  // A: K-major (a [M, K]) unless trans_a (a [K, M]); B: K-major when trans_b (b [N, K]).
  l.a = {p.a.data_ptr(), p.trans_a ? d.k : d.m, p.trans_a ? d.m : d.k, d.lda, d.sa, !p.trans_a};
  l.b = {p.b.data_ptr(), p.trans_b ? d.n : d.k, p.trans_b ? d.k : d.n, d.ldb, d.sb, p.trans_b};
  l.epi = epi_params(p, e, d);
  if (p.a_nonzero.defined()) {
    l.a_nonzero = static_cast<const unsigned char*>(p.a_nonzero.data_ptr());
    l.nz_sm = p.a_nonzero.stride(0), l.nz_sk = p.a_nonzero.stride(1);
  }
  return l;
}

void run_kiln(const GemmProblem& p, const EpilogueArgs& e, const Dims& d, const GemmOptions& o) {
  std::string why;
  KILN_CHECK(supported(p, d, &why), "gemm: kiln's kernel does not apply: ", why, " (use backend auto or cublaslt)");
  KILN_CHECK(o.tile_n == 0 || o.tile_n == 128 || o.tile_n == 256, "gemm: tile_n ", o.tile_n, " is not 0, 128 or 256");
  const sm::Launch l = make_launch(p, e, d, o);
  const bool ok = p.a.dtype() == DType::bf16 ? sm::launch_bf16(l) : sm::launch_f16(l);
  KILN_CHECK(ok, "gemm: no TMA tensor map describes the operands (strides, alignment or driver)");
}

// ---- the cuBLASLt path ----

template <class T>
__global__ void epilogue_pass(sm::RtEpilogue<T> epi, const float* __restrict__ acc, int64_t lda, int64_t sa, int m,
                              int n, int batch) {
  const int64_t pairs = (n + 1) / 2, total = static_cast<int64_t>(batch) * m * pairs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int b = static_cast<int>(i / (static_cast<int64_t>(m) * pairs));
    const int64_t rem = i - static_cast<int64_t>(b) * m * pairs;
    const int r = static_cast<int>(rem / pairs), c = static_cast<int>(rem % pairs) * 2;
    const float* a = acc + b * sa + r * lda + c;
    typename sm::RtEpilogue<T>::Row row{};
    epi.element(b, r, c, a[0], c + 1 < n ? a[1] : 0.f, c + 1 < n, row);
  }
}

// A warp per (batch, row, tile column): lane l takes column pairs l and l + 32 of the tile,
// then the warp merges its states lane 0 first (a fixed order).
template <class T>
__global__ void row_pass(sm::RtEpilogue<T> epi, const float* __restrict__ acc, int64_t lda, int64_t sa, int m, int n,
                         int batch, int tiles) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t total = static_cast<int64_t>(batch) * m * tiles;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; w < total; w += warps) {
    const int b = static_cast<int>(w / (static_cast<int64_t>(m) * tiles));
    const int64_t rem = w - static_cast<int64_t>(b) * m * tiles;
    const int r = static_cast<int>(rem / tiles), t = static_cast<int>(rem % tiles);
    typename sm::RtEpilogue<T>::Row row = epi.row_init();
    for (int q = 0; q < 2; ++q) {
      const int c = t * 128 + 2 * (lane + 32 * q);
      if (c < n) {
        const float* a = acc + b * sa + r * lda + c;
        epi.element(b, r, c, a[0], c + 1 < n ? a[1] : 0.f, c + 1 < n, row);
      }
    }
    for (int off = 1; off < 32; off <<= 1) {
      typename sm::RtEpilogue<T>::Row other;
      other.a = __shfl_xor_sync(0xffffffffu, row.a, off);
      other.b = __shfl_xor_sync(0xffffffffu, row.b, off);
      row = (lane & off) ? epi.merge(other, row) : epi.merge(row, other);
    }
    if (lane == 0) epi.row_done(b, r, t, row);
  }
}

unsigned grid_for(int64_t threads, int sms) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((threads + 255) / 256, int64_t{sms} * 16)));
}

// D = alpha · op(a) · op(b) (+ bias) + beta · D through the planner, D of dtype `out_dt` at
// `out` with row stride ldo and batch stride so.
void lt_product(const GemmProblem& p, const Dims& d, void* out, DType out_dt, int64_t ldo, int64_t so, float alpha,
                float beta, const void* bias) {
  DeviceContext& ctx = ::kiln::kernels::cuda::context(p.out.device().index);
  const int64_t es = 2, eo = static_cast<int64_t>(itemsize(out_dt));
  lt::PlanKey key;
  key.ta = p.trans_b, key.tb = p.trans_a;
  key.m = d.n, key.n = d.m, key.k = d.k;
  key.at = key.bt = lt::cuda_type(p.a.dtype(), "gemm");
  key.ct = lt::cuda_type(out_dt, "gemm");
  key.lda = d.ldb, key.ldb = d.lda, key.ldc = ldo;
  key.batch = d.batch;
  if (d.batch > 1) key.stride_a = d.sb, key.stride_b = d.sa, key.stride_c = so;
  key.align_a = lt::alignment_of(p.b.data_ptr(), d.batch > 1 ? d.sb * es : 0);
  key.align_b = lt::alignment_of(p.a.data_ptr(), d.batch > 1 ? d.sa * es : 0);
  key.align_c = lt::alignment_of(out, d.batch > 1 ? so * eo : 0);
  if (bias) key.epilogue = CUBLASLT_EPILOGUE_BIAS;
  const lt::Plan& plan = lt::plan(ctx, key, "gemm");
  lt::run_f32(ctx, plan, alpha, p.b.data_ptr(), p.a.data_ptr(), beta, out, "gemm", nullptr, bias);
}

template <class T>
void finish_unfused(const GemmProblem& p, const EpilogueArgs& e, const Dims& d, const Tensor& acc) {
  const DeviceContext& ctx = ::kiln::kernels::cuda::context(p.out.device().index);
  const cudaStream_t s = ::kiln::kernels::cuda::stream(ctx.device);
  sm::EpiParams ep = epi_params(p, e, d);
  ep.alpha = 1.0f;  // already in the product
  const sm::RtEpilogue<T> epi{ep};
  const int64_t lda = d.n, sa = d.m * d.n;
  if (e.kind == Epilogue::row_lse || e.kind == Epilogue::row_sumsq) {
    const int tiles = static_cast<int>(row_stat_tiles(d.n));
    row_pass<T><<<grid_for(d.batch * d.m * tiles * 32, ctx.sm_count), 256, 0, s>>>(
        epi, acc.data<float>(), lda, sa, static_cast<int>(d.m), static_cast<int>(d.n), static_cast<int>(d.batch), tiles);
  } else {
    epilogue_pass<T><<<grid_for(d.batch * d.m * ((d.n + 1) / 2), ctx.sm_count), 256, 0, s>>>(
        epi, acc.data<float>(), lda, sa, static_cast<int>(d.m), static_cast<int>(d.n), static_cast<int>(d.batch));
  }
  KILN_CUDA_CHECK_LAUNCH("gemm epilogue pass");
}

void run_cublaslt(const GemmProblem& p, const EpilogueArgs& e, const Dims& d) {
  KILN_CHECK(d.batch <= INT32_MAX && d.m < kMax32 && d.n < kMax32, "gemm: sizes too large for cuBLASLt here");
  if (d.k == 0) {
    // The product is zero: the epilogue on zeros.
    if (e.kind == Epilogue::accumulate) return;
  }
  switch (e.kind) {
    case Epilogue::none:
      if (d.k > 0) return lt_product(p, d, p.out.data_ptr(), p.out.dtype(), d.ldo, d.so, e.alpha, 0.f, nullptr);
      break;
    case Epilogue::accumulate:
      return lt_product(p, d, p.out.data_ptr(), DType::f32, d.ldo, d.so, e.alpha, 1.f, nullptr);
    case Epilogue::bias:
      if (d.k > 0) return lt_product(p, d, p.out.data_ptr(), p.out.dtype(), d.ldo, d.so, e.alpha, 0.f, e.bias.data_ptr());
      break;
    default: break;
  }
  Tensor acc = Tensor::empty({d.batch, d.m, d.n}, DType::f32, p.out.device());
  if (d.k > 0) lt_product(p, d, acc.data_ptr(), DType::f32, d.n, d.m * d.n, e.alpha, 0.f, nullptr);
  else ::kiln::kernels::cuda::fill(acc, 0.0);
  if (p.a.dtype() == DType::bf16) finish_unfused<__nv_bfloat16>(p, e, d, acc);
  else finish_unfused<__half>(p, e, d, acc);
}

// ---- auto ----

MachineKey machine_key(int device) {
  cudaDeviceProp prop{};
  KILN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int driver = 0;
  KILN_CUDA_CHECK(cudaDriverGetVersion(&driver));
  return {std::string(prop.name) + " sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + " " +
              std::to_string(prop.multiProcessorCount) + "SM",
          std::to_string(driver), KILN_VERSION};
}

// The process's choice caches, one per device (each over the same file). A cache, not state:
// an entry is a measurement that a later one would repeat.
ChoiceCache& choice_cache(int device) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<ChoiceCache>>* caches = new std::vector<std::unique_ptr<ChoiceCache>>;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(caches->size()) <= device) caches->resize(device + 1);
  auto& c = (*caches)[device];
  if (!c) {
    const std::string dir = gemm_cache_dir_from_env();
    c = std::make_unique<ChoiceCache>(dir.empty() ? "" : dir + "/gemm_choices.tsv", machine_key(device));
  }
  return *c;
}

double median_ms(const std::function<void()>& f, int device) {
  for (int i = 0; i < 2; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) t.push_back(::kiln::kernels::cuda::time_ms(device, f));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Choice measure(const GemmProblem& p, const EpilogueArgs& e, const Dims& d, const GemmOptions& o) {
  // Scratch outputs, so the caller's out (accumulate reads it) is left alone.
  GemmProblem q = p;
  q.out = Tensor::empty(p.out.shape(), p.out.dtype(), p.out.device());
  ::kiln::kernels::cuda::fill(q.out, 0.0);
  EpilogueArgs f = e;
  if (e.row_stats.defined()) f.row_stats = Tensor::empty(e.row_stats.shape(), DType::f32, p.out.device());
  if (e.kind == Epilogue::residual && e.residual.data_ptr() == p.out.data_ptr()) f.residual = q.out;
  const Dims dq = check_problem(q, f);
  const int dev = p.out.device().index;
  Choice c;
  c.kiln_ms = median_ms([&] { run_kiln(q, f, dq, o); }, dev);
  c.cublaslt_ms = median_ms([&] { run_cublaslt(q, f, dq); }, dev);
  c.kiln = c.kiln_ms < c.cublaslt_ms;
  return c;
}

Backend choose(const GemmProblem& p, const EpilogueArgs& e, const Dims& d, const GemmOptions& o) {
  if (o.backend != Backend::automatic) return o.backend;
  if (d.k == 0 || !supported(p, d, nullptr)) return Backend::cublaslt;
  ChoiceCache& cache = choice_cache(p.out.device().index);
  const std::string key = problem_key(p, e);
  if (auto c = cache.lookup(key)) return c->kiln ? Backend::kiln : Backend::cublaslt;
  const Choice c = measure(p, e, d, o);
  cache.store(key, c);
  return c.kiln ? Backend::kiln : Backend::cublaslt;
}

}  // namespace

void gemm(const GemmProblem& p, const EpilogueArgs& e, const GemmOptions& o) {
  const Dims d = check_problem(p, e);
  if (d.batch == 0 || d.m == 0 || d.out_cols == 0) return;
  if (choose(p, e, d, o) == Backend::kiln) {
    KILN_CHECK(d.k > 0, "gemm: kiln's kernel needs K > 0 (use backend auto or cublaslt)");
    run_kiln(p, e, d, o);
  } else {
    run_cublaslt(p, e, d);
  }
}

bool kiln_stores_by_tma(const GemmProblem& p, const EpilogueArgs& e, const GemmOptions& o) {
  const Dims d = check_problem(p, e);
  if (d.k == 0 || !supported(p, d, nullptr)) return false;
  CUtensorMap map;
  return sm::encode_output_map(make_launch(p, e, d, o), p.a.dtype() == DType::bf16, &map);
}

bool kiln_supported(const GemmProblem& p, const EpilogueArgs& e, std::string* why) {
  const Dims d = check_problem(p, e);
  if (d.k == 0) {
    if (why) *why = "K is 0";
    return false;
  }
  return supported(p, d, why);
}

Backend chosen_backend(const GemmProblem& p, const EpilogueArgs& e, const GemmOptions& o) {
  const Dims d = check_problem(p, e);
  return choose(p, e, d, o);
}

namespace {
__global__ void combine_kernel(float* __restrict__ out, const float* __restrict__ stats, int64_t rows, int64_t tiles,
                               bool lse) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float* s = stats + r * tiles;
    if (!lse) {
      float acc = 0.f;
      for (int64_t t = 0; t < tiles; ++t) acc += s[t];
      out[r] = acc;
      continue;
    }
    float m = -INFINITY;
    for (int64_t t = 0; t < tiles; ++t) m = fmaxf(m, s[t]);
    if (m == -INFINITY) {
      out[r] = -INFINITY;
      continue;
    }
    float acc = 0.f;
    for (int64_t t = 0; t < tiles; ++t) acc += expf(s[t] - m);
    out[r] = m + logf(acc);
  }
}
}  // namespace

void combine_row_stats(const Tensor& out, const Tensor& stats, Epilogue kind) {
  KILN_CHECK(kind == Epilogue::row_lse || kind == Epilogue::row_sumsq, "combine_row_stats: kind must be row_lse or row_sumsq");
  KILN_CHECK(stats.is_cuda() && out.device() == stats.device() && stats.dtype() == DType::f32 &&
                 out.dtype() == DType::f32 && stats.is_contiguous() && out.is_contiguous() && stats.dim() >= 1,
             "combine_row_stats: contiguous f32 tensors on one CUDA device");
  const int64_t tiles = stats.size(-1), rows = tiles ? stats.numel() / tiles : 0;
  KILN_CHECK(out.numel() == rows, "combine_row_stats: out has ", out.numel(), " elements, expected ", rows);
  if (rows == 0) return;
  const DeviceContext& ctx = ::kiln::kernels::cuda::context(out.device().index);
  combine_kernel<<<grid_for(rows, ctx.sm_count), 256, 0, ::kiln::kernels::cuda::stream(ctx.device)>>>(
      out.data<float>(), stats.data<float>(), rows, tiles, kind == Epilogue::row_lse);
  KILN_CUDA_CHECK_LAUNCH("combine_row_stats");
}

// ---- the matmul op's entry (select.h) ----

bool kiln_gemm_for_matmul(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b) {
  const Backend want = default_backend();
  if (want == Backend::cublaslt) return false;
  if (a.dtype() != DType::bf16 && a.dtype() != DType::f16) return false;
  if (g.beta != 0.0 || g.k == 0) return false;
  // matmul's operands are contiguous [batch, rows, cols] (kernels/matmul.h): seen as such over
  // their own storage (a layout, not an op: no autograd here).
  auto as_3d = [](const Tensor& t, int64_t batch, int64_t rows, int64_t cols) {
    const Shape shape{batch, rows, cols};
    return Tensor::from_storage(t.storage(), shape, contiguous_strides(shape), t.offset(), t.dtype());
  };
  const int64_t ar = g.trans_a ? g.k : g.m, ac = g.trans_a ? g.m : g.k;
  const int64_t br = g.trans_b ? g.n : g.k, bc = g.trans_b ? g.k : g.n;
  if (ar * ac == 0 || br * bc == 0) return false;
  GemmProblem p;
  p.a = as_3d(a, a.numel() / (ar * ac), ar, ac);
  p.b = as_3d(b, b.numel() / (br * bc), br, bc);
  p.out = as_3d(out, g.batch, g.m, g.n);
  p.trans_a = g.trans_a, p.trans_b = g.trans_b;
  if ((g.batch_stride_a == 0 && p.a.size(0) != 1) || (g.batch_stride_b == 0 && p.b.size(0) != 1)) return false;
  EpilogueArgs e;
  GemmOptions o;
  o.backend = want;
  std::string why;
  const Dims d = check_problem(p, e);
  if (!supported(p, d, &why)) {
    if (want == Backend::kiln && std::getenv("KILN_GEMM_VERBOSE")) std::cerr << "kiln: gemm: cuBLASLt: " << why << "\n";
    return false;
  }
  gemm(p, e, o);
  return true;
}

}  // namespace kiln::kernels::gemm
